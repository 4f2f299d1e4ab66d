"""A local stand-in for the Hugging Face Hub's HTTP API, for tests of `make publish`.

It serves, on 127.0.0.1, the calls huggingface_hub's real client makes to publish and read back
a model repository: whoami, repo creation, card YAML validation, preupload (upload modes and
remote oids), git-LFS batch with the "basic" transfer, NDJSON commits, the recursive tree,
revision info and file resolution. Repositories live in memory as a list of commits, each a
full snapshot ``{path: bytes}``. Every request is recorded with its headers and body, so a test
can assert where a token went.

It refuses what the real Hub refuses on these paths, with the real Hub's status and message:
card metadata it cannot parse (README.md front matter that is not YAML, not a mapping, or a
``base_model`` that is a local path rather than a Hub id; 400 from ``/api/validate-yaml`` and
from a commit), and a commit whose ``parentCommit`` is not the branch head any more (412, "A
commit has happened since"). ``before_commit`` runs a callable before the next commit is
handled: another writer committing meanwhile. There is no Xet storage here: a client that
takes huggingface_hub's Xet upload path gets a 404, so a passing push shows it took git-LFS.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".png")  # like the Hub's default .gitattributes
GITATTRIBUTES = b"".join(
    f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES
)
# huggingface_hub's own pattern for a card's YAML front matter (repocard.REGEX_YAML_BLOCK).
FRONT_MATTER = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")
STALE_PARENT = "A commit has happened since. Please refresh and try again."


def card_metadata_errors(card: str) -> list[str]:
    """What the Hub's metadata validation says about a README.md; [] when it accepts it."""
    match = FRONT_MATTER.search(card)
    if match is None:
        return []
    try:
        metadata = yaml.safe_load(match.group(2))
    except yaml.YAMLError as err:
        return [f"Invalid YAML in README.md metadata: {' '.join(str(err).split())}"]
    if metadata is None:
        return []
    if not isinstance(metadata, dict):
        return ["README.md metadata must be a YAML mapping"]
    errors = []
    base = metadata.get("base_model")
    for name in base if isinstance(base, list) else [base] if base else []:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)):
            errors.append(f'"base_model" with value "{name}" is not valid: use a model id')
    return errors


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Commit:
    oid: str
    title: str
    description: str
    files: dict[str, bytes]
    lfs: set[str]


@dataclass
class Repo:
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class LocalHub:
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict[str, Any]] = []
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content
        self.upload_tickets: dict[str, tuple[str, int]] = {}
        self.before_commit: list = []  # callables(repo), each run once before a commit
        self.endpoint = ""

    # ---- serving

    @contextlib.contextmanager
    def running(self):
        """Serve on a free loopback port in a thread; yield the endpoint URL."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=2**31)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield self.endpoint
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def routes(self):
        return [
            ("GET", r"/api/whoami-v2", self.whoami),
            ("GET", r"/api/agent-harnesses", self.harnesses),
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", self.repo_info),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", self.commit),
            ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)", self.tree),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", self.lfs_batch),
            ("PUT", r"/lfs-upload/(?P<ticket>[0-9a-f]+)", self.lfs_put),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/verify", self.lfs_verify),
            ("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve),
            ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve),
        ]

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "url": str(request.rel_url),
                "headers": dict(request.headers),
                "body": body,
            }
        )
        for method, pattern, handler in self.routes():
            match = re.fullmatch(pattern, request.path)
            if request.method == method and match:
                try:
                    return await handler(request, body, **match.groupdict())
                except HubError as err:
                    headers = {"X-Error-Message": " ".join(str(err).split())}
                    if err.code:
                        headers["X-Error-Code"] = err.code
                    return web.json_response(
                        {"error": str(err)}, status=err.status, headers=headers
                    )
        return web.json_response({"error": f"no route {request.method} {request.path}"}, status=404)

    # ---- auth and lookup

    def user(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        user = self.tokens.get(auth.removeprefix("Bearer "))
        if not auth.startswith("Bearer ") or user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def repo(self, request: web.Request, repo_id: str, write: bool = False) -> Repo:
        user = self.user(request) if write else None
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if repo.private and user is None:
            user = self.user(request)
        if (write or repo.private) and repo_id.split("/")[0] != user:
            raise HubError(403, f"{user} cannot write to {repo_id}")
        return repo

    @staticmethod
    def revision(repo: Repo, rev: str | None) -> Commit:
        if rev in (None, "main"):
            return repo.head
        for commit in repo.commits:
            if commit.oid == rev:
                return commit
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def new_commit(self, repo: Repo, title: str, description: str, files, lfs) -> Commit:
        commit = Commit(uuid.uuid4().hex + uuid.uuid4().hex[:8], title, description, files, lfs)
        repo.commits.append(commit)
        return commit

    # ---- handlers

    async def whoami(self, request, body):
        return web.json_response({"type": "user", "name": self.user(request), "orgs": []})

    async def harnesses(self, request, body):
        return web.json_response({"standardEnvVars": [], "harnesses": {}})

    async def validate_yaml(self, request, body):
        errors = card_metadata_errors(json.loads(body)["content"])
        return web.json_response(
            {"errors": [{"message": e} for e in errors], "warnings": []},
            status=400 if errors else 200,
        )

    async def create_repo(self, request, body):
        user = self.user(request)
        spec = json.loads(body)
        repo_id = f"{spec.get('organization') or user}/{spec['name']}"
        url = f"{self.endpoint}/{repo_id}"
        if repo_id.split("/")[0] != user:
            raise HubError(403, f"{user} cannot create repositories under {repo_id}")
        if repo_id in self.repos:
            return web.json_response(
                {"error": "You already created this repo", "url": url}, status=409
            )
        repo = self.repos[repo_id] = Repo(private=spec.get("visibility") == "private")
        self.new_commit(repo, "initial commit", "", {".gitattributes": GITATTRIBUTES}, set())
        return web.json_response({"url": url, "name": repo_id})

    async def repo_info(self, request, body, repo, rev=None):
        commit = self.revision(self.repo(request, repo), rev)
        siblings = [{"rfilename": path} for path in sorted(commit.files)]
        if request.query.get("blobs") in ("1", "true", "True"):  # files_metadata=True
            for sibling in siblings:
                data = commit.files[sibling["rfilename"]]
                sibling |= {"size": len(data), "blobId": git_blob_id(data)}
                if sibling["rfilename"] in commit.lfs:
                    pointer = f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n"
                    sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                      "size": len(data), "pointerSize": len(pointer)}  # fmt: skip
        return web.json_response({"id": repo, "sha": commit.oid, "siblings": siblings})

    async def preupload(self, request, body, repo, rev):
        head = self.revision(self.repo(request, repo, write=True), rev)
        answer = []
        for f in json.loads(body)["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) and f["size"] > 0
            entry = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular"}
            entry["shouldIgnore"] = False
            if f["path"] in head.files:
                data = head.files[f["path"]]
                entry["oid"] = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
            answer.append(entry)
        return web.json_response({"files": answer})

    async def lfs_batch(self, request, body, repo):
        self.repo(request, repo, write=True)
        objects = []
        for obj in json.loads(body)["objects"]:
            if obj["oid"] in self.lfs_objects:
                objects.append({"oid": obj["oid"], "size": obj["size"]})  # stored: no actions
                continue
            ticket = uuid.uuid4().hex
            self.upload_tickets[ticket] = (obj["oid"], obj["size"])
            actions = {
                "upload": {"href": f"{self.endpoint}/lfs-upload/{ticket}"},
                "verify": {"href": f"{self.endpoint}/{repo}.git/info/lfs/objects/verify"},
            }
            objects.append({"oid": obj["oid"], "size": obj["size"], "actions": actions})
        return web.json_response({"transfer": "basic", "objects": objects})

    async def lfs_put(self, request, body, ticket):
        oid, size = self.upload_tickets.pop(ticket, (None, None))
        if oid != hashlib.sha256(body).hexdigest() or size != len(body):
            raise HubError(400, "the uploaded bytes do not match the announced oid and size")
        self.lfs_objects[oid] = body
        return web.Response()

    async def lfs_verify(self, request, body, repo):
        self.repo(request, repo, write=True)
        if json.loads(body)["oid"] not in self.lfs_objects:
            raise HubError(404, "object not uploaded")
        return web.json_response({"success": True})

    async def commit(self, request, body, repo, rev):
        target = self.repo(request, repo, write=True)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header, operations = lines[0]["value"], lines[1:]
        while self.before_commit:
            self.before_commit.pop(0)(target)
        parent = self.revision(target, rev)
        if header.get("parentCommit") not in (None, parent.oid):
            raise HubError(412, STALE_PARENT)
        files, lfs = dict(parent.files), set(parent.lfs)
        for op in operations:
            value = op["value"]
            path = value["path"]
            if op["key"] == "file":
                files[path] = base64.b64decode(value["content"])
                lfs.discard(path)
            elif op["key"] == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    raise HubError(400, f"LFS object of {path} was never uploaded")
                files[path] = self.lfs_objects[value["oid"]]
                lfs.add(path)
            elif op["key"] == "deletedFile":
                files.pop(path, None)
            else:
                raise HubError(400, f"operation {op['key']} is not supported here")
        errors = card_metadata_errors(files.get("README.md", b"").decode(errors="replace"))
        if errors:
            raise HubError(400, "Invalid metadata in README.md.\n" + "\n".join(errors))
        commit = self.new_commit(
            target, header["summary"], header.get("description", ""), files, lfs
        )
        url = f"{self.endpoint}/{repo}/commit/{commit.oid}"
        return web.json_response({"commitOid": commit.oid, "commitUrl": url})

    async def tree(self, request, body, repo, rev):
        commit = self.revision(self.repo(request, repo), rev)
        entries = []
        for path in sorted(commit.files):
            data = commit.files[path]
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if path in commit.lfs:
                pointer = f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n"
                entry["oid"] = git_blob_id(pointer.encode())
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": len(pointer),
                }
            entries.append(entry)
        folders = sorted({p.rsplit("/", 1)[0] for p in commit.files if "/" in p})
        entries += [
            {"type": "directory", "path": d, "oid": git_blob_id(d.encode())} for d in folders
        ]
        return web.json_response(entries)

    async def resolve(self, request, body, repo, rev, path):
        commit = self.revision(self.repo(request, repo), rev)
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound")
        data = commit.files[path]
        etag = hashlib.sha256(data).hexdigest() if path in commit.lfs else git_blob_id(data)
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{etag}"'}
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(data))})
        return web.Response(body=data, headers=headers)
