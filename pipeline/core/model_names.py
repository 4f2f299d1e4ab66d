"""The names of models: the verifier every stage serves, the drafter's repository, and whether
a name is a Hub repository id or a path on this machine.

A name is a Hub repository id (``owner/name``) unless it exists as a file or folder here; the
drafter is published as ``release.repo_id``, or described under a placeholder to replace.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.core.config import HUB_REPO_ID, Profile
from pipeline.core.portable import REPO_ROOT


def looks_like_path(name: str) -> bool:
    """A filesystem path rather than a Hub id (``org/name``), by its spelling alone."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def served_revision(profile: Profile) -> str | None:
    """The verifier revision every server loads: ``verifier.revision``, else, for a Hub id, the
    commit the verifier stage downloaded (its manifest), so that servers, which resolve the id
    offline, load exactly the files that stage checked."""
    import json

    if profile.verifier.revision or not is_hub_id(profile.verifier.model):
        return profile.verifier.revision
    manifest = profile.run.run_dir / "verifier" / "manifest.json"
    try:
        return json.loads(manifest.read_text())["outputs"]["revision"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_hub_id(name: str | None) -> bool:
    """A Hub repository id ("owner/name"), as opposed to a local file or folder."""
    if not name or not re.match(HUB_REPO_ID, name):
        return False
    return not (Path(name).exists() or (REPO_ROOT / name).exists())


def verifier_path(profile: Profile) -> str:
    """The model folder or Hub id every stage serves as the verifier: the folder in the run
    (``<run>/verifier/model``) of one the verifier stage makes (built, or from a package), else
    ``verifier.model``."""
    if profile.verifier.build is not None or profile.verifier.package is not None:
        return str(profile.run.run_dir / "verifier" / "model")
    return str(profile.verifier.model)


def drafter_repo_id(profile: Profile) -> str:
    """The repository the drafter is released as: release.repo_id, or a placeholder."""
    return profile.release.repo_id or f"<namespace>/{profile.run.name}"
