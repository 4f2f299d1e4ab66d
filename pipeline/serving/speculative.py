"""The ``--speculative-config`` a vLLM server gets for one speculation method.

Shared plumbing: the eval stage measures with it and ``pipeline.tools.serve`` deploys with it, so
a deployment runs the drafter exactly as eval measured it. Imports no stage.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.config import Profile


def speculative_config(
    profile: Profile, method: str, k: int | None, drafter: str | None
) -> dict[str, Any] | None:
    """vLLM's speculative config for ``method`` at ``k``: ``ngram`` (with the profile's lookup
    bounds) or ``eagle3`` (the ``drafter`` checkpoint); None for any other (``baseline``, a
    ``served`` deployment measured as it is)."""
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": profile.eval.ngram_prompt_lookup_min,
            "prompt_lookup_max": profile.eval.ngram_prompt_lookup_max,
        }
    if method == "eagle3":
        return {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    return None
