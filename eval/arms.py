"""The arms of an evaluation: each server configuration eval measures, named as it reports them."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.config import Profile


@dataclass(frozen=True)
class Arm:
    """One server configuration: ``baseline`` (no speculation), ``ngram`` or ``eagle3`` at k,
    a reference drafter (``eval.reference_drafters``, method ``eagle3``) at k, or ``served``:
    a running deployment measured as it is."""

    method: str
    k: int | None = None
    reference: str | None = None  # the reference drafter's name

    @property
    def series(self) -> str:
        """What results, tables and plots call the arm's drafter at every k."""
        return self.reference or self.method

    @property
    def label(self) -> str:
        return self.series if self.k is None else f"{self.series}-k{self.k}"


def planned_arms(profile: Profile) -> list[Arm]:
    """The paired baseline, each method at each k, then each reference drafter at each of its
    k (eval's, unless it names its own)."""
    e = profile.eval
    ks = e.num_speculative_tokens
    return (
        [Arm("baseline")]
        + [Arm(m, k) for m in e.methods for k in ks]
        + [
            Arm(r.method, k, r.name)
            for r in e.reference_drafters
            for k in r.num_speculative_tokens or ks
        ]
    )
