"""Stage `publish`: assemble the drafter's release folder, and with ``--push`` put it on the Hub.

Run as: python -m release.publish --config configs/tiny.yaml [--push]
        (make publish; make publish PUSH=1)

Reads the `licenses`, `train`, `eval` and `card` stages (and the manifests of every stage before);
writes ``<run>/publish/release/`` (the speculators config and weights, the card as README.md,
the verifier's LICENSE, plots, eval results, the license report, every stage's manifest) and
``manifest.json``. Without ``--push`` it is a dry run: it prints what would be pushed, and where.

Invariants:
- it refuses, naming the reason and the fix, when the license check failed, when any input is
  stale (a license check of other data, an eval of another training run, a card of another
  eval: ``pipeline.core.contracts``), when the drafter's files are not the ones train hashed or
  eval measured, when the card was rendered for another repository, and, to push, when no
  token is available;
- the token comes from the environment (HF_TOKEN) or the HF cache, through huggingface_hub, and
  goes only into the Authorization header of its requests: no file, log, card or manifest
  written here holds it;
- a push creates the repository if needed, commits only when some file differs from the remote
  (a second identical publish commits nothing), names the git SHA in the commit message, removes
  remote files the release no longer has, then lists the remote files and checks every one
  against the local sha256 / git blob id;
- the push is one commit on top of the remote head it compared against (``parent_commit``): if
  anyone committed since, the Hub refuses it and nothing of theirs is overwritten or deleted;
- files go up through git-LFS, not Xet: huggingface_hub's Xet path splits a large folder into
  several commits, and the LFS path is the one the tests run against the local Hub;
- the release names no path of the machine that built it: JSON files (manifests, eval results,
  the license report) go through pipeline.core.manifest.portable, and a release in which any file
  still holds the run folder, the checkout, the virtual environment or the home folder is
  refused, naming the file;
- the release folder is rebuilt beside the old one and swapped in, never left half-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, get_token, hf_hub_download
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError

from pipeline.core.atomic_files import atomic_write_json, sha256_file
from pipeline.core.config import Profile
from pipeline.core.contracts import CONTRACTS, MEASUREMENTS, STAGES, PublishOutputs
from pipeline.core.drafter import DRAFTER_FILES, drafter_digest
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    StageInputError,
    all_succeeded,
    manifest_path,
    now,
    passed_license_report,
    read_input,
    stage_dir,
    write_manifest,
)
from pipeline.core.model_names import drafter_repo_id, verifier_path
from pipeline.core.portable import REPO_ROOT, portable, portable_text

RELEASE = "release"
# Stages whose manifests ship in the release, as manifests/<stage>.json, with those of the
# measurements the profile asks for (the card shows them).
SHIPPED_MANIFESTS = tuple(s for s in STAGES if s != "publish")
# Files a Hub repository starts with that the release does not own.
HUB_OWNED = {".gitattributes"}
# The stage that wrote each released file: what to rerun when one names a machine path.
WRITTEN_BY = {"README.md": "card", "config.json": "train", "model.safetensors": "train"}


class PublishError(PipelineError):
    """The release may not be published as it is; the message names why and the fix."""


def short(digest: dict[str, str] | None) -> str:
    return "none" if not digest else digest["model.safetensors"][:12]


def verified_inputs(profile: Profile) -> dict[str, Any]:
    """Every precondition of a release, checked; what assembling it needs. Staleness (an eval
    of another checkpoint, a card of another eval, a license check of other data) is the
    contracts' one check; what is left is that the files shipped are the files trained."""
    licenses = passed_license_report(profile, "publish")
    train = read_input(profile, "publish", "train")
    drafter = Path(train.outputs.drafter)
    shipped = drafter_digest(drafter)
    if shipped != train.outputs.drafter_sha256:
        raise PublishError(
            f"the drafter checkpoint {drafter} changed since training: it is "
            f"{short(shipped)}, train recorded {short(train.outputs.drafter_sha256)}; rerun "
            "`make train`, `make eval` and `make card`"
        )
    try:
        evaluated = read_input(profile, "publish", "eval").outputs.drafter_sha256
    except StageInputError as err:
        if manifest_path(profile, "eval").exists():
            raise
        raise PublishError(
            f"no eval results for run {profile.run.name!r}: run `make eval` (then `make card`) "
            "before publishing; a drafter is not released unmeasured"
        ) from err
    if evaluated != shipped:
        raise PublishError(
            f"the eval results belong to drafter checkpoint {short(evaluated)}, but the drafter "
            f"to publish ({drafter}) is {short(shipped)}: rerun `make eval` and `make card`"
        )
    card = read_input(profile, "publish", "card").outputs
    if card.repo_id != drafter_repo_id(profile):
        raise PublishError(
            f"the model card was rendered for {card.repo_id}, not {drafter_repo_id(profile)}: "
            "rerun `make card` with the same release.repo_id"
        )
    if card.license != licenses["drafter_license"]:
        raise PublishError("the card's license is not the license check's: rerun `make card`")
    return {
        "licenses": licenses,
        "drafter": drafter,
        "drafter_sha256": shipped,
        "card": card,
        "git_sha": train.git["sha"] or "unknown",
        "data_revision": read_input(profile, "publish", "generate").data_revision,
    }


def license_text(profile: Profile, licenses: dict[str, Any]) -> bytes:
    """The verifier's license file, plus the terms of any non-commercial data."""
    name = licenses["verifier"]["license_file"]
    model = profile.verifier.model
    if profile.verifier.build is not None:
        path = REPO_ROOT / name
    elif profile.verifier.package is not None:  # copied beside the model it made
        path = Path(verifier_path(profile)) / name
    elif Path(model).is_dir():
        path = Path(model) / name
    else:
        try:
            path = Path(hf_hub_download(model, name, revision=profile.verifier.revision))
        except Exception as err:  # offline without the file cached, a gated repo, ...
            raise PublishError(
                f"cannot read {name} of the verifier {model}: {err}; download the verifier's "
                "files (the drafter ships its license) and rerun"
            ) from None
    if not path.is_file():
        raise PublishError(f"the verifier's license file {path} does not exist (licenses.yaml)")
    text = path.read_bytes()
    non_commercial = [s for s in licenses["sources"] if s.get("non_commercial")]
    if non_commercial:
        terms = "\n".join(f"- {s['source']} ({s['dataset']}): {s['spdx']}" for s in non_commercial)
        text += (
            "\n\n---\nTraining data terms. This drafter was trained on data licensed for "
            f"non-commercial use only:\n{terms}\nIt may not be used commercially.\n"
        ).encode()
    return text


def _place(source: Path, target: Path) -> None:
    """Hard-link a large file into the release (same volume), else copy it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def assemble(profile: Profile, inputs: dict[str, Any]) -> Path:
    """Build the release folder beside the old one, then swap it in; return it."""
    folder = stage_dir(profile, "publish")
    folder.mkdir(parents=True, exist_ok=True)
    release, building = folder / RELEASE, folder / f"{RELEASE}.building"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    for name in DRAFTER_FILES:
        _place(inputs["drafter"] / name, building / name)
    card_dir = stage_dir(profile, "card")
    shutil.copy2(card_dir / inputs["card"].card, building / "README.md")
    for plot in inputs["card"].plots:
        shutil.copy2(card_dir / plot, building / plot)
    (building / "LICENSE").write_bytes(license_text(profile, inputs["licenses"]))
    (building / "eval").mkdir()
    shutil.copy2(stage_dir(profile, "eval") / "results.md", building / "eval/results.md")
    (building / "manifests").mkdir()
    records = {
        "eval/results.json": stage_dir(profile, "eval") / "results.json",
        "data_licenses.json": stage_dir(profile, "licenses") / "report.json",
    }
    for stage in (*SHIPPED_MANIFESTS, *(m for m in MEASUREMENTS if getattr(profile, m))):
        records[f"manifests/{stage}.json"] = stage_dir(profile, stage) / "manifest.json"
    for name, source in records.items():
        with contextlib.suppress(FileNotFoundError):  # a stage a profile did not run
            # As written, not as read_manifest resolves it; runs from before manifests were
            # portable get their paths made relative here.
            record = portable(profile, json.loads(source.read_text()))
            atomic_write_json(building / name, record)
    check_no_machine_paths(profile, building)
    if release.exists():
        retired = folder / f"{RELEASE}.old"
        shutil.rmtree(retired, ignore_errors=True)
        release.rename(retired)
        building.rename(release)
        shutil.rmtree(retired)
    else:
        building.rename(release)
    return release


def published_text(path: Path) -> str:
    """What a released file says in text: a safetensors file's JSON header, else its bytes
    (latin-1, so that paths inside a binary file show too)."""
    if path.suffix == ".safetensors":
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            return fh.read(size).decode("utf-8", errors="replace")
    return path.read_bytes().decode("latin-1")


def written_by(name: str) -> str:
    """The make target that writes a released file: what to rerun when it names a machine path."""
    if name.startswith("manifests/"):
        return CONTRACTS[Path(name).stem].target
    if name == "data_licenses.json" or name == "LICENSE":
        return "licenses"
    return "eval" if name.startswith("eval/") or name.endswith(".png") else "publish"


def check_no_machine_paths(profile: Profile, folder: Path) -> None:
    """Refuse a release in which a file names the run folder, checkout, venv or home folder."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        text = published_text(path)
        if portable_text(profile, text) != text:
            name = path.relative_to(folder).as_posix()
            stage = WRITTEN_BY.get(name) or written_by(name)
            raise PublishError(
                f"{name} names a path of this machine (the run folder, checkout, virtual "
                f"environment or home folder): a release carries paths relative to the run "
                f"folder; rerun `make {stage}` with this version of the pipeline"
            )


def local_files(release: Path) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(release).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(release.rglob("*"))
        if p.is_file()
    }


def git_blob_id(path: Path) -> str:
    """The git object id the Hub reports for a file stored without LFS."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    digest.update(path.read_bytes())
    return digest.hexdigest()


def remote_files(api: HfApi, repo_id: str, revision: str) -> dict[str, Any]:
    return {
        f.path: f
        for f in api.list_repo_tree(repo_id, recursive=True, revision=revision)
        if hasattr(f, "blob_id")  # files, not folders
    }


def differing(release: Path, local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """Local files the remote lacks or holds with other content, then remote files not local."""
    changed = []
    for path, meta in local.items():
        theirs = remote.get(path)
        if theirs is None or theirs.size != meta["bytes"]:
            changed.append(path)
        elif theirs.lfs is not None:
            if theirs.lfs.sha256 != meta["sha256"]:
                changed.append(path)
        elif theirs.blob_id != git_blob_id(release / path):
            changed.append(path)
    return changed + sorted(set(remote) - set(local) - HUB_OWNED)


def token_source() -> str | None:
    """Where huggingface_hub will find a token: said, never shown."""
    if get_token() is None:
        return None
    return "environment" if os.environ.get("HF_TOKEN") else "HF cache"


@contextlib.contextmanager
def lfs_uploads() -> Iterator[None]:
    """Upload through git-LFS in one commit rather than Xet (huggingface_hub reads the switch
    behind HF_HUB_DISABLE_XET at call time)."""
    saved = hub_constants.HF_HUB_DISABLE_XET
    hub_constants.HF_HUB_DISABLE_XET = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_DISABLE_XET = saved


def hub_refusal(repo_id: str, err: Exception) -> PublishError:
    """One line for what the Hub refused, and the fix."""
    if not isinstance(err, HfHubHTTPError):  # the card's metadata, checked before any upload
        problems = "; ".join(line.lstrip("- ") for line in str(err).splitlines()[1:] if line)
        return PublishError(
            f"the Hub rejected the model card's metadata (README.md): {problems or err}; fix "
            "model_card/ (or the card stage's inputs) and rerun `make card`"
        )
    status = err.response.status_code if err.response is not None else "no response"
    if status == 412:
        return PublishError(
            f"{repo_id} changed while publishing (someone committed after the remote state this "
            "release was compared with); nothing was pushed: rerun `make publish PUSH=1`"
        )
    hint = " (is the token valid and allowed to write?)" if status in (401, 403) else ""
    said = f": {' '.join(err.server_message.split())}" if err.server_message else ""
    return PublishError(f"the Hub refused a request for {repo_id}: {status}{hint}{said}")


def push(profile: Profile, release: Path, local: dict[str, Any], git_sha: str) -> dict[str, Any]:
    repo_id, revision = profile.release.repo_id, profile.release.revision
    if repo_id is None:
        raise PublishError("release.repo_id is not set: name the Hub repository, e.g. you/drafter")
    if token_source() is None:
        raise PublishError(
            "no Hugging Face token: set HF_TOKEN in the environment or run `hf auth login` "
            "(the token is read from there and sent only in the Authorization header)"
        )
    api = HfApi()  # the token and HF_ENDPOINT are resolved by huggingface_hub itself
    try:
        user = api.whoami()["name"]
        api.create_repo(repo_id, private=profile.release.private, exist_ok=True)
        parent = api.model_info(repo_id, revision=revision).sha
        before = remote_files(api, repo_id, parent)
        changed = differing(release, local, before)
        commit = None
        if changed:
            with lfs_uploads():
                info = api.upload_folder(
                    repo_id=repo_id,
                    folder_path=release,
                    revision=revision,
                    parent_commit=parent,
                    commit_message=f"Release {profile.run.name} drafter, git {git_sha[:12]}",
                    # The repository mirrors the release: files of an earlier release that this
                    # one no longer has (a renamed plot) are removed in the same commit.
                    delete_patterns="*",
                    commit_description=(
                        f"Pushed by eagle3-release from git {git_sha}; {len(changed)} changed "
                        f"file(s): {', '.join(changed[:20])}"
                    ),
                )
            commit = {"oid": info.oid, "url": info.commit_url}
        after = remote_files(api, repo_id, revision)
        head = api.model_info(repo_id, revision=revision).sha
    except HfHubHTTPError as err:
        raise hub_refusal(repo_id, err) from None
    except ValueError as err:
        if "Invalid metadata in README.md" not in str(err):
            raise
        raise hub_refusal(repo_id, err) from None
    still = differing(release, local, after)
    if still:
        raise PublishError(f"after the push, the remote copies differ from local: {still}")
    return {
        "user": user,
        "pushed": bool(changed),
        "changed": changed,
        "commit": commit,
        "remote_head": head,
        "remote_check": {"files": len(local), "matched": len(after.keys() & local.keys())},
    }


def run(profile: Profile, push_to_hub: bool = False) -> dict[str, Any]:
    started = now()
    inputs = verified_inputs(profile)
    release = assemble(profile, inputs)
    local = local_files(release)
    git_sha = inputs["git_sha"]
    target = profile.release.repo_id or "(release.repo_id not set)"
    print(
        f"release folder {release} -> {target} (revision {profile.release.revision}, "
        f"{'private' if profile.release.private else 'public'})"
    )
    for path, meta in local.items():
        print(f"  {meta['bytes']:>12,d}  {meta['sha256'][:12]}  {path}")
    outcome: dict[str, Any] = {"mode": "push" if push_to_hub else "dry-run"}
    if push_to_hub:
        outcome |= push(profile, release, local, git_sha)
        print(
            f"pushed commit {outcome['commit']['oid']}"
            if outcome["pushed"]
            else f"{target} is already up to date at {outcome['remote_head']}; nothing pushed"
        )
    else:
        source = token_source()
        outcome["token"] = source
        print(
            "dry run: nothing pushed; `make publish PUSH=1` pushes "
            + (f"(token from the {source})" if source else "(no token found: it would refuse)")
        )
    licenses = inputs["licenses"]
    return write_manifest(
        profile,
        "publish",
        started_at=started,
        counts=all_succeeded(len(local)),
        outputs=PublishOutputs(
            **outcome,
            release=RELEASE,
            repo_id=profile.release.repo_id,
            revision=profile.release.revision,
            private=profile.release.private,
            files=local,
            drafter_sha256=inputs["drafter_sha256"],
            license=licenses["drafter_license"],
            data=[
                {
                    k: s[k]
                    for k in (
                        "source",
                        "dataset",
                        "spdx",
                        "rows",
                        "prompt_tokens",
                        "completion_tokens",
                    )
                }
                for s in licenses["sources"]
            ],
        ),
        data_revision=inputs["data_revision"],
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import report, stage_parser, unsharded
    from pipeline.core.config import load_profile

    parser = stage_parser("publish")
    parser.add_argument(
        "--push", action="store_true", help="push to release.repo_id (default: a dry run)"
    )
    args = parser.parse_args(argv)
    report(lambda: run(unsharded(load_profile(args.config, args.overrides)), push_to_hub=args.push))


if __name__ == "__main__":
    main()
