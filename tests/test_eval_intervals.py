"""Eval's intervals and its noise-aware choice of k, on levels built by eval's own code from
per-request measurements drawn here (a fixed seed), so the truth is known."""

from __future__ import annotations

import numpy as np
import pytest

from eval.arms import Arm
from eval.guards import compare_with_baseline
from eval.intervals import Bootstrap, acceptance_length_ci, add_intervals, choose_k
from eval.measure import Pass, pooled_level
from eval.summary import headline, k_advice
from pipeline.serving.spec_decode_metrics import SpecDecodeCounters

pytestmark = pytest.mark.unit

BOOTSTRAP = Bootstrap(resamples=2000, seed=0)
TOKENS = 64


def level(arm: Arm, concurrency: int, tpot: float, prompts: int = 24, noise: float = 0.05,
          length: float | None = None, seed: int = 0) -> dict:  # fmt: skip
    """A level as ``eval.measure`` pools it: ``prompts`` requests of ``TOKENS`` tokens whose
    time per token is ``tpot`` times a per-prompt factor (prompts differ) and timing noise;
    drafting arms accept ``length - 1`` tokens per draft at concurrency 1."""
    rng = np.random.default_rng(seed)
    hardness = np.random.default_rng(99).uniform(0.8, 1.2, prompts)  # the same prompts every arm
    requests, counters = [], {}
    for i in range(prompts):
        req = {
            "id": f"p{i}",
            "category": ["writing", "math"][i % 2],
            "completion_tokens": TOKENS,
            "latency_s": float(TOKENS * tpot * hardness[i] * (1 + noise * rng.standard_normal())),
            "token_ids": list(range(TOKENS)),
            "text": "",
        }
        if length is not None and concurrency == 1:
            drafts = 30
            accepted = round(drafts * (length - 1) * hardness[i])
            req |= {"drafts": drafts, "accepted_tokens": accepted}
            counters[req["id"]] = SpecDecodeCounters(
                drafts=drafts, draft_tokens=drafts * arm.k, accepted=accepted
            )
        requests.append(req)
    wall = sum(r["latency_s"] for r in requests)
    delta = sum(counters.values(), SpecDecodeCounters())
    return pooled_level([Pass(requests, wall, counters, delta)], arm, concurrency)


def run(arm: Arm, levels: list[dict]) -> dict:
    return {"method": arm.method, "k": arm.k, "series": arm.series, "reference": None,
            "levels": levels}  # fmt: skip


def runs_of(arms: dict[Arm, dict[int, tuple[float, float | None]]]) -> list[dict]:
    """Runs with a baseline at tpot 1.0 and each arm's (tpot, acceptance length) by
    concurrency, speedups and intervals as eval computes them."""
    runs = [run(Arm("baseline"), [level(Arm("baseline"), c, 1.0, seed=1) for c in (1, 4)])]
    for n, (arm, by_c) in enumerate(arms.items()):
        levels = [level(arm, c, t, length=a, seed=10 + n) for c, (t, a) in by_c.items()]
        runs.append(run(arm, levels))
    compare_with_baseline(runs)
    add_intervals(runs, BOOTSTRAP, min_prompts=20)
    return runs


def test_intervals_hold_the_measured_figures_and_paired_speedup_is_tight():
    runs = runs_of({Arm("eagle3", 3): {1: (0.5, 2.5), 4: (0.8, None)}})
    lv = runs[1]["levels"][0]
    low, high = lv["speedup_ci95"]
    assert low < lv["speedup"] < high
    # Pairing removes the prompts' own spread (+-20%); what is left is the timing noise.
    assert high - low < 0.2
    low, high = lv["mean_acceptance_length_ci95"]
    assert low < lv["acceptance"]["mean_acceptance_length"] < high
    # Acceptance needs each request's counters: none at concurrency 4.
    assert runs[1]["levels"][1]["mean_acceptance_length_ci95"] is None
    assert runs[1]["levels"][1]["speedup_ci95"] is not None


def test_categories_carry_intervals_and_too_few_prompts_are_marked():
    runs = runs_of({Arm("eagle3", 1): {1: (0.7, 1.6), 4: (0.9, None)}})
    for figs in runs[1]["levels"][0]["per_category"].values():
        assert figs["prompts"] == 12 and figs["too_few_prompts"]  # 12 < min_prompts=20
        assert figs["speedup_ci95"][0] < figs["speedup"] < figs["speedup_ci95"][1]


def test_no_interval_from_one_prompt_and_a_constant_sample_is_exact():
    one = {"p0": {"category": "x", "drafts": 10, "accepted_tokens": 5}}
    assert acceptance_length_ci(BOOTSTRAP, one) is None
    same = {f"p{i}": {"category": "x", "drafts": 10, "accepted_tokens": 5} for i in range(8)}
    assert acceptance_length_ci(BOOTSTRAP, same) == [1.5, 1.5]
    assert acceptance_length_ci(BOOTSTRAP, {"p0": {"category": "x"}, "p1": {}}) is None


def test_a_lead_within_the_noise_takes_the_smaller_k():
    # k=3 is 2% faster than k=1 with 5% timing noise per request: not a lead to act on.
    runs = runs_of({Arm("eagle3", 1): {1: (0.50, 1.5)}, Arm("eagle3", 3): {1: (0.49, 2.5)}})
    options = [(r["k"], r["levels"][0]) for r in runs[1:]]
    k, choice = choose_k(options, BOOTSTRAP)
    assert k == 1 and choice["best_k"] == 3
    [compared] = choice["compared"]
    assert compared["k"] == 1 and not compared["beyond_noise"] and compared["ci95"][0] <= 1


def test_a_lead_beyond_the_noise_takes_the_larger_k():
    runs = runs_of({Arm("eagle3", 1): {1: (0.6, 1.5)}, Arm("eagle3", 3): {1: (0.4, 2.5)}})
    k, choice = choose_k([(r["k"], r["levels"][0]) for r in runs[1:]], BOOTSTRAP)
    assert k == 3 and choice["compared"][0]["beyond_noise"]
    assert choice["compared"][0]["ci95"][0] > 1


def test_the_headline_says_which_k_to_use_at_each_concurrency():
    runs = runs_of(
        {
            Arm("eagle3", 1): {1: (0.60, 1.5), 4: (1.10, None)},
            Arm("eagle3", 3): {1: (0.40, 2.5), 4: (1.30, None)},
        }
    )
    summary = headline(runs, BOOTSTRAP)
    assert summary["num_speculative_tokens"] == 3
    assert summary["speedup_ci95"][0] < summary["speedup"] < summary["speedup_ci95"][1]
    rows = summary["k_by_concurrency"]
    assert [(r["concurrency"], r["k"], r["pays"]) for r in rows] == [(1, 3, True), (4, 1, False)]
    assert summary["k_advice"] == (
        "k=3 up to concurrency 1; no speculation at concurrency 4, where no k was faster beyond "
        "the noise. Measured at concurrency 1, 4."
    )


def test_advice_when_speculation_never_pays():
    rows = [
        {"concurrency": 1, "k": 1, "speedup": 0.8, "speedup_ci95": [0.7, 0.9], "pays": False},
        {"concurrency": 4, "k": 1, "speedup": 0.6, "speedup_ci95": [0.5, 0.7], "pays": False},
    ]
    assert k_advice(rows).startswith("no k was measured faster than no speculation")
    rows = [{**r, "pays": True} for r in rows]
    assert k_advice(rows) == "k=1 up to concurrency 4. Measured at concurrency 1, 4."
    rows = [
        {"concurrency": 1, "k": 3, "pays": True},
        {"concurrency": 4, "k": 1, "pays": True},
        {"concurrency": 16, "k": 1, "pays": False},
        {"concurrency": 32, "k": 1, "pays": True},
        {"concurrency": 64, "k": 1, "pays": True},
    ]
    assert k_advice(rows) == (
        "k=3 up to concurrency 1; k=1 at concurrency 4; no speculation at concurrency 16, where "
        "no k was faster beyond the noise; k=1 from concurrency 32 up to 64. Measured at "
        "concurrency 1, 4, 16, 32, 64."
    )


def test_counter_deltas_add_up():
    a = SpecDecodeCounters(drafts=2, draft_tokens=6, accepted=3, accepted_per_pos={0: 2, 1: 1})
    b = SpecDecodeCounters(drafts=1, draft_tokens=3, accepted=1, accepted_per_pos={0: 1})
    total = a + b
    assert (total.drafts, total.accepted, total.accepted_per_pos) == (3, 4, {0: 3, 1: 1})
    assert total - b == a
