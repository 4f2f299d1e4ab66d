"""The drafter checkpoint: the files that make one, its config, and its digest.

A speculators EAGLE-3 checkpoint is a folder with ``config.json`` and ``model.safetensors``;
those two files are what train writes, eval measures, the card describes and publish ships, and
``drafter_digest`` (their sha256) is how each of them names the checkpoint it saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import sha256_file
from pipeline.core.errors import PipelineError

# What a speculators drafter checkpoint needs to load: the files evaluated, hashed, published.
DRAFTER_FILES = ("config.json", "model.safetensors")


class DrafterError(PipelineError):
    """A drafter checkpoint is incomplete or unreadable."""


def drafter_config(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json``."""
    path = checkpoint / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DrafterError(f"cannot read the drafter's config {path}: {err}") from None


def aux_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The verifier layers a drafter reads (without the last, which vLLM adds itself)."""
    return config.get("eagle_aux_hidden_state_layer_ids")


def drafter_digest(checkpoint: Path) -> dict[str, str]:
    """sha256 of each file of a drafter checkpoint: how eval results name what they measured."""
    missing = [name for name in DRAFTER_FILES if not (checkpoint / name).is_file()]
    if missing:
        raise DrafterError(f"drafter checkpoint {checkpoint} lacks {', '.join(missing)}")
    return {name: sha256_file(checkpoint / name) for name in DRAFTER_FILES}
