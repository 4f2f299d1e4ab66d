"""The ``--speculative-config`` a vLLM server gets for one speculation method.

Shared plumbing: the eval stage measures with it and ``pipeline.tools.serve`` deploys with it, so
a deployment runs the drafter exactly as eval measured it. Imports no stage.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.config import Profile


def draft_attention_backend(profile: Profile, reference: str | None = None) -> str | None:
    """The drafter's attention backend: a reference drafter's own, else the profile's
    ``server.draft_attention_backend``; None lets vLLM choose."""
    for ref in profile.eval.reference_drafters:
        if ref.name == reference and ref.attention_backend:
            return ref.attention_backend
    return profile.server.draft_attention_backend


def speculative_config(
    profile: Profile, method: str, k: int | None, drafter: str | None, reference: str | None = None
) -> dict[str, Any] | None:
    """vLLM's speculative config for ``method`` at ``k``: ``ngram`` (with the profile's lookup
    bounds) or ``eagle3`` (the ``drafter`` checkpoint, ours or the ``reference`` drafter's, with
    its attention backend); None for any other (``baseline``, a ``served`` deployment measured as
    it is)."""
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": profile.eval.ngram_prompt_lookup_min,
            "prompt_lookup_max": profile.eval.ngram_prompt_lookup_max,
        }
    if method == "eagle3":
        spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
        if backend := draft_attention_backend(profile, reference):
            spec["attention_backend"] = backend
        return spec
    return None
