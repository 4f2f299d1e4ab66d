"""The arms of an evaluation: each server configuration eval measures, named as it reports them."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.config import Profile


@dataclass(frozen=True)
class Arm:
    """One server configuration: ``baseline`` (no speculation), ``ngram`` or ``eagle3`` at k,
    or ``served``: a running deployment measured as it is."""

    method: str
    k: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.k is None else f"{self.method}-k{self.k}"


def planned_arms(profile: Profile) -> list[Arm]:
    e = profile.eval
    return [Arm("baseline")] + [Arm(m, k) for m in e.methods for k in e.num_speculative_tokens]
