"""Reference drafters (``eval.reference_drafters``): published drafters measured beside ours.

Before any server starts, each is fetched (a local folder, or its Hub snapshot), read in its
layout and checked against the served verifier (hidden size, vocabulary, layer ids: a drafter
for another verifier is refused by name, not measured as noise). A drafter in the original
EAGLE layout is converted into speculators' format in ``<eval>/reference-drafters/<name>/``
(:func:`pipeline.training.pretrained_drafter.prepare_drafter`: its layer ids in vLLM's
convention, nothing the converter drops lost); one in speculators' format, or an MLA drafter
(which vLLM serves only from its own config), is served from its folder as it is.

Invariant: results record each reference by its Hub id (or its folder's name), layout, layer
ids and the sha256 of the files served, never a path of this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import sha256_file
from pipeline.core.config import Profile
from pipeline.core.contracts import VerifierOutputs
from pipeline.training.pretrained_drafter import (
    WEIGHT_FILES,
    PretrainedDrafterError,
    check_fits,
    fetch_drafter,
    prepare_drafter,
    provenance,
    read_drafter,
)
from pipeline.training.text_view import text_view, verifier_config


def served_digest(folder: Path) -> dict[str, str]:
    """sha256 of the config and weights vLLM loads from ``folder`` (safetensors or .bin)."""
    names = ("config.json", *WEIGHT_FILES)
    return {n: sha256_file(folder / n) for n in names if (folder / n).is_file()}


def prepare_references(
    profile: Profile, verifier: VerifierOutputs, folder: Path
) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """The folder each reference drafter is served from, by name, and what results record of
    each; converted where vLLM needs it."""
    paths: dict[str, str] = {}
    records: dict[str, dict[str, Any]] = {}
    if not profile.eval.reference_drafters:
        return paths, records
    config = verifier_config(verifier.model, verifier.revision)
    for ref in profile.eval.reference_drafters:
        name = f"eval.reference_drafters {ref.name}"
        drafter = read_drafter(fetch_drafter(ref), layer_ids_from=ref.layer_ids_from)
        ids = check_fits(drafter, config, name)
        if drafter.kind == "eagle":
            view = text_view(verifier.model, verifier.revision, folder / "verifier-text")
            served = prepare_drafter(drafter, folder / "reference-drafters" / ref.name, view, ids)
        elif ref.layer_ids_from == "sglang":
            raise PretrainedDrafterError(
                f"{name}: a {drafter.kind} drafter is served from its own config, which would "
                f"keep SGLang's layer ids; write vLLM's ({ids}) into it and drop layer_ids_from"
            )
        else:
            served = drafter.folder
        paths[ref.name] = str(served)
        records[ref.name] = {
            **provenance(ref, drafter),
            "converted": served != drafter.folder,
            "layer_ids": ids,
            "served_sha256": served_digest(served),
        }
    return paths, records
