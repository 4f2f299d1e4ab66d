"""Portable records: what a manifest or a published file may say about this machine's paths.

Manifests ship in the release, so they hold no path of the machine that wrote them. A path
under the run folder is recorded relative to it (the folder itself and its parents as ``.``,
``..``), a path under the project's virtual environment, checkout or the user's home relative
to that, and ``relative_paths`` maps each such field (a JSON pointer) to its base;
:func:`resolved` makes them absolute again on this machine, so readers see absolute paths and
a run folder can be moved or copied whole. A machine path inside a longer string (a message, a
JSON-encoded argument) is replaced by a placeholder (``<run>``, ``<venv>``, ``<repo>``, ``~``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import Profile
from pipeline.core.drafter import drafter_config

REPO_ROOT = Path(__file__).resolve().parents[2]

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
    config = drafter_config(checkpoint)
    verifier = config.get("speculators_config", {}).get("verifier", {})
    named = verifier.get("name_or_path")
    if not isinstance(named, str):
        return
    name = relative_path(profile, named)
    if name != named:
        verifier["name_or_path"] = name
        atomic_write_json(path, config)
