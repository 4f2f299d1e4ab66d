"""`make bench`'s figures: alternating rounds, ratios within a round, and a verdict that says
when the spread is larger than the difference."""

from __future__ import annotations

import pytest

from pipeline.tools.bench import compared, interleaved, verdict


@pytest.mark.unit
def test_rounds_rotate_the_order_so_drift_falls_on_every_contender():
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = interleaved(fns, repeats=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(t) == 3 for t in times.values())


@pytest.mark.unit
def test_ratios_pair_each_round_and_the_verdict_reads_the_whole_range():
    result = compared([1.0, 2.0, 1.2], [1.0, 1.0, 1.5], target=0.9)
    assert result["ratio"] == {"min": 0.8, "median": 1.0, "max": 2.0}
    assert result["baseline_s"]["median"] == 1.2 and result["repeats"] == 3
    assert result["verdict"] == "straddles target"
    assert verdict({"min": 0.95, "median": 1.0, "max": 1.1}, 0.95) == "meets target"
    assert verdict({"min": 0.5, "median": 0.6, "max": 0.7}, 0.95) == "misses target"
