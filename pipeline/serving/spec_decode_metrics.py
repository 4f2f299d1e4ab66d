"""Speculative-decoding acceptance from vLLM's Prometheus ``/metrics``, by counter deltas.

vLLM's conventions (see the EAGLE-3 and vLLM docs): with k draft tokens per step,
- acceptance rate = accepted tokens / draft tokens (always reported with k);
- mean acceptance length = 1 + accepted tokens / drafts;
- per-position acceptance rate i = accepted at position i / drafts.

Counters are cumulative over the server's life, so a measurement is the difference of two
snapshots taken around a run. Parsing uses prometheus-client's text parser; samples of one
counter are summed over labels other than ``position`` (engines, model names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float = 0
    draft_tokens: float = 0
    accepted: float = 0
    generation_tokens: float = 0
    prompt_tokens: float = 0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(before, -1)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Two deltas together (e.g. the requests of one category, each measured alone)."""
        return self._combine(other, 1)

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        positions = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return SpecDecodeCounters(
            drafts=self.drafts + sign * other.drafts,
            draft_tokens=self.draft_tokens + sign * other.draft_tokens,
            accepted=self.accepted + sign * other.accepted,
            generation_tokens=self.generation_tokens + sign * other.generation_tokens,
            prompt_tokens=self.prompt_tokens + sign * other.prompt_tokens,
            accepted_per_pos={
                p: self.accepted_per_pos.get(p, 0) + sign * other.accepted_per_pos.get(p, 0)
                for p in sorted(positions)
            },
        )


def parse_counters(text: str) -> SpecDecodeCounters:
    """Sum the spec-decode counters in a Prometheus exposition text."""
    totals = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED, GENERATION_TOKENS, PROMPT_TOKENS), 0.0)
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # skip _created timestamps
            if family.name == ACCEPTED_PER_POS:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif family.name in totals:
                totals[family.name] += sample.value
    return SpecDecodeCounters(
        drafts=totals[DRAFTS],
        draft_tokens=totals[DRAFT_TOKENS],
        accepted=totals[ACCEPTED],
        generation_tokens=totals[GENERATION_TOKENS],
        prompt_tokens=totals[PROMPT_TOKENS],
        accepted_per_pos=dict(sorted(per_pos.items())),
    )


def scrape(base_url: str, timeout: float = 10) -> SpecDecodeCounters:
    resp = httpx.get(f"{base_url}/metrics", timeout=timeout)
    resp.raise_for_status()
    return parse_counters(resp.text)


def acceptance(delta: SpecDecodeCounters, k: int) -> dict[str, object]:
    """Acceptance figures from a counter delta, in vLLM's conventions."""
    drafts = delta.drafts
    return {
        "num_speculative_tokens": k,
        "drafts": int(drafts),
        "draft_tokens": int(delta.draft_tokens),
        "accepted_tokens": int(delta.accepted),
        "acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens else None,
        "mean_acceptance_length": 1 + delta.accepted / drafts if drafts else None,
        "per_position_acceptance": [
            delta.accepted_per_pos.get(p, 0) / drafts if drafts else None for p in range(k)
        ],
    }
