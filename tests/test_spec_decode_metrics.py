"""Acceptance arithmetic on a /metrics text in vLLM's exposition format."""

from pathlib import Path

import pytest

from pipeline.serving.spec_decode_metrics import SpecDecodeCounters, acceptance, parse_counters

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_metrics.txt"


def test_parse_counters_sums_totals_and_positions():
    c = parse_counters(FIXTURE.read_text())
    assert (c.drafts, c.draft_tokens, c.accepted, c.generation_tokens) == (120, 360, 240, 400)
    assert c.accepted_per_pos == {0: 100, 1: 80, 2: 60}


def test_acceptance_from_delta_follows_vllm_conventions():
    after = parse_counters(FIXTURE.read_text())
    before = SpecDecodeCounters(drafts=20, draft_tokens=60, accepted=40, accepted_per_pos={0: 20})
    a = acceptance(after - before, k=3)
    assert a["drafts"] == 100 and a["draft_tokens"] == 300 and a["accepted_tokens"] == 200
    assert a["acceptance_rate"] == pytest.approx(200 / 300)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 200 / 100)
    assert a["per_position_acceptance"] == pytest.approx([0.8, 0.8, 0.6])


def test_no_drafts_gives_none_not_a_division_error():
    a = acceptance(SpecDecodeCounters(), k=2)
    assert a["acceptance_rate"] is None and a["mean_acceptance_length"] is None
    assert a["per_position_acceptance"] == [None, None]
