"""A stand-in Docker engine: the few Engine API endpoints the server driver calls, on a unix
socket, so that the real docker SDK client is tested without a daemon.

A "container" is a local process: the image decides what its entrypoint + command become
(``Image.argv``) and which environment it bakes in (``Image.env``); stdout and stderr go to a
file that the logs endpoint serves in the engine's multiplexed frame format. Every request body
is kept in ``requests`` for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

API_VERSION = "1.45"


@dataclass
class Image:
    argv: Callable[[list[str]], list[str]]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeContainer:
    id: str
    name: str
    body: dict[str, Any]
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def status(self) -> str:
        if self.proc is None:
            return "created"
        return "running" if self.proc.poll() is None else "exited"

    def inspect(self) -> dict[str, Any]:
        status = self.status
        code = self.proc.returncode if status == "exited" else 0
        return {
            "Id": self.id,
            "Name": f"/{self.name}",
            "Image": self.body.get("Image"),
            "State": {"Status": status, "Running": status == "running", "ExitCode": code},
            "Config": {
                "Image": self.body.get("Image"),
                "Labels": self.body.get("Labels") or {},
                "Tty": False,
                "Env": self.body.get("Env") or [],
            },
            "HostConfig": self.body.get("HostConfig") or {},
        }


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"message": message}, status=status)


class FakeDockerEngine:
    def __init__(self, socket_path: Path, images: dict[str, Image]) -> None:
        self.socket_path = socket_path
        self.images = images
        self.containers: dict[str, FakeContainer] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, raw body)
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def docker_host(self) -> str:
        return f"unix://{self.socket_path}"

    def __enter__(self) -> FakeDockerEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        for c in list(self.containers.values()):
            self._kill(c)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket_path)).start()

    def add_container(self, name: str, labels: dict[str, str], image: str = "left-behind") -> str:
        """A container created outside the driver (e.g. by a run that was killed)."""
        cid = f"{next(self._ids):064x}"
        log = self.socket_path.with_name(f"{cid[-12:]}.log")
        log.touch()
        self.containers[cid] = FakeContainer(cid, name, {"Image": image, "Labels": labels}, log)
        return cid

    def bodies(self, path_suffix: str) -> list[dict[str, Any]]:
        return [json.loads(b) for _, p, b in self.requests if p.endswith(path_suffix) and b]

    # -- the API -------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = await request.text()
        path = re.sub(r"^/v[0-9.]+/", "/", request.path)
        self.requests.append((request.method, path, raw))
        if path in ("/version", "/_ping"):
            return web.json_response({"ApiVersion": API_VERSION, "Version": "fake"})
        if request.method == "POST" and path == "/containers/create":
            return self._create(request.query.get("name", ""), json.loads(raw))
        if request.method == "GET" and path == "/containers/json":
            return self._list(request.query)
        m = re.fullmatch(r"/containers/([^/]+)(/[a-z]+)?", path)
        if m is None:
            return _error(404, f"fake engine: no route for {request.method} {path}")
        c = self._find(m.group(1))
        if c is None:
            return _error(404, f"No such container: {m.group(1)}")
        action = (request.method, m.group(2) or "")
        if action == ("GET", "/json"):
            return web.json_response(c.inspect())
        if action == ("POST", "/start"):
            return self._start(c)
        if action == ("POST", "/stop"):
            return self._stop(c, float(request.query.get("t", "10")))
        if action == ("GET", "/logs"):
            return web.Response(body=_frames(c.log_path.read_bytes()))
        if action == ("DELETE", ""):
            if c.status == "running" and request.query.get("force") not in ("1", "True", "true"):
                return _error(409, f"container {c.name} is running: stop it or force")
            self._kill(c)
            del self.containers[c.id]
            return web.Response(status=204)
        return _error(404, f"fake engine: no route for {request.method} {path}")

    def _find(self, ref: str) -> FakeContainer | None:
        for c in self.containers.values():
            if ref in (c.id, c.name) or (len(ref) >= 12 and c.id.startswith(ref)):
                return c
        return None

    def _create(self, name: str, body: dict[str, Any]) -> web.Response:
        if body.get("Image") not in self.images:
            return _error(404, f"No such image: {body.get('Image')}")
        if any(c.name == name for c in self.containers.values()):
            return _error(409, f'Conflict. The container name "/{name}" is already in use')
        cid = f"{next(self._ids):064x}"
        log = self.socket_path.with_name(f"{cid[-12:]}.log")
        self.containers[cid] = FakeContainer(cid, name or cid[:12], body, log)
        return web.json_response({"Id": cid, "Warnings": []}, status=201)

    def _start(self, c: FakeContainer) -> web.Response:
        if c.proc is not None:
            return web.Response(status=304)
        image = self.images[c.body["Image"]]
        argv = image.argv([*(c.body.get("Entrypoint") or []), *(c.body.get("Cmd") or [])])
        env = {"PATH": os.environ["PATH"], **image.env}
        env.update(item.split("=", 1) for item in c.body.get("Env") or [])
        with open(c.log_path, "ab") as log:
            c.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=c.body.get("WorkingDir") or None,
                start_new_session=True,
            )
        return web.Response(status=204)

    def _stop(self, c: FakeContainer, grace_s: float) -> web.Response:
        if c.status != "running":
            return web.Response(status=304)
        os.killpg(c.proc.pid, signal.SIGTERM)
        try:
            c.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._kill(c)
        return web.Response(status=204)

    def _kill(self, c: FakeContainer) -> None:
        if c.status == "running":
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait(timeout=30)

    def _list(self, query: Any) -> web.Response:
        labels = json.loads(query.get("filters", "{}")).get("label", [])
        show_all = query.get("all") in ("1", "True", "true")
        out = []
        for c in self.containers.values():
            have = c.body.get("Labels") or {}
            wanted = (lbl.partition("=") for lbl in labels)
            if not all(have.get(k) == v if sep else k in have for k, sep, v in wanted):
                continue
            if show_all or c.status == "running":
                out.append({"Id": c.id, "Names": [f"/{c.name}"], "Labels": have})
        return web.json_response(out)


def _frames(payload: bytes) -> bytes:
    """The engine's multiplexed log stream (no TTY): 8-byte header per frame, stream 1."""
    return struct.pack(">BxxxL", 1, len(payload)) + payload if payload else b""
