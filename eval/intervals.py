"""95% intervals for eval's figures, and the choices of k that respect them.

An interval is a bootstrap over prompts (scipy's BCa, percentile where BCa is degenerate;
``eval.bootstrap_resamples`` resamples, seeded by ``run.seed``): a prompt is resampled with all
its repeats, and a speedup is resampled paired with the baseline's latency on the same prompts.
So an interval carries prompt-to-prompt variation and each request's timing noise; it cannot
carry a drift between servers (each arm is one server), which repeats do not see either. Above
concurrency 1 the requests in flight share the server's steps, so their latencies are
correlated and an interval over prompts is narrower than the truth: the k chosen there is
indicative. Acceptance intervals need each request's own counters, so they exist at
concurrency 1 only.

Invariants:
- every figure is a ratio of sums over the same prompts (time per output token, 1 + accepted /
  drafts), so a resample is the figure itself on other prompts, never a mean of ratios;
- fewer than two prompts give no interval (None), never a zero-width one;
- a larger k is chosen over a smaller one only when its lead is beyond the noise: the 95%
  interval of its speedup over the smaller k's, paired on prompts, lies above 1
  (:func:`choose_k`). The best k is picked by its point estimate before that test, so a lead
  just past the noise is chance somewhat more often than 1 in 20; the smaller k is the safe
  side to err on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Bootstrap:
    resamples: int
    seed: int

    def interval(
        self, statistic: Callable[..., np.ndarray], columns: Sequence[Sequence[float]]
    ) -> list[float] | None:
        """The 95% interval of ``statistic`` over paired ``columns`` (one value per prompt each),
        or None with fewer than two prompts or a statistic undefined on the data."""
        if len(columns[0]) < 2:
            return None
        data = tuple(np.asarray(c, dtype=float) for c in columns)
        for method in ("BCa", "percentile"):
            with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
                warnings.simplefilter("ignore")  # degenerate data: the fallback handles it
                low, high = stats.bootstrap(
                    data,
                    statistic,
                    paired=True,
                    vectorized=True,
                    n_resamples=self.resamples,
                    confidence_level=CONFIDENCE,
                    method=method,
                    rng=np.random.default_rng(self.seed),
                ).confidence_interval
            if np.isfinite(low) and np.isfinite(high):
                return [float(low), float(high)]
        return None


def speedup_statistic(base_latency, base_tokens, latency, tokens, axis=-1):
    """Time per output token of the first pair over the second's: a speedup."""
    return (base_latency.sum(axis) / base_tokens.sum(axis)) / (latency.sum(axis) / tokens.sum(axis))


def acceptance_length_statistic(drafts, accepted, axis=-1):
    """vLLM's mean acceptance length, 1 + accepted / drafts."""
    return 1 + accepted.sum(axis) / drafts.sum(axis)


def speedup_ci(
    bootstrap: Bootstrap, base: dict[str, dict[str, Any]], mine: dict[str, dict[str, Any]]
) -> list[float] | None:
    """The interval of ``mine``'s speedup over ``base`` (samples by prompt id), paired on the
    prompts both measured."""
    ids = [pid for pid in mine if pid in base]
    return bootstrap.interval(
        speedup_statistic,
        [
            [base[i]["latency_s"] for i in ids],
            [base[i]["completion_tokens"] for i in ids],
            [mine[i]["latency_s"] for i in ids],
            [mine[i]["completion_tokens"] for i in ids],
        ],
    )


def acceptance_length_ci(
    bootstrap: Bootstrap, samples: dict[str, dict[str, Any]]
) -> list[float] | None:
    """The interval of the mean acceptance length, when each prompt has its own counters."""
    if not samples or any("drafts" not in s for s in samples.values()):
        return None
    drafted = [s for s in samples.values() if s["drafts"]]  # a one-token reply drafts nothing
    return bootstrap.interval(
        acceptance_length_statistic,
        [[s["drafts"] for s in drafted], [s["accepted_tokens"] for s in drafted]],
    )


def add_intervals(runs: list[dict[str, Any]], bootstrap: Bootstrap, min_prompts: int) -> None:
    """``speedup_ci95`` and ``mean_acceptance_length_ci95`` on every level of every arm but the
    baseline (its sampled level too, paired on the same prompts and seeds), and on each
    category, which is also marked ``too_few_prompts`` below ``min_prompts``. Needs the levels'
    ``samples`` (before :func:`eval.measure.take_outputs`)."""
    baseline = next((r for r in runs if r["method"] == "baseline"), None)
    base_levels = {lv["concurrency"]: lv["samples"] for lv in (baseline or {}).get("levels", [])}
    if baseline and "sampled" in baseline:
        base_levels["sampled"] = baseline["sampled"]["samples"]
    for run in runs:
        if run is baseline:
            continue
        sampled = [("sampled", run["sampled"])] if "sampled" in run else []
        for key, level in [(lv["concurrency"], lv) for lv in run["levels"]] + sampled:
            base = base_levels.get(key)
            samples = level["samples"]
            level["speedup_ci95"] = speedup_ci(bootstrap, base, samples) if base else None
            level["mean_acceptance_length_ci95"] = acceptance_length_ci(bootstrap, samples)
            for category, figs in level.get("per_category", {}).items():
                mine = {pid: s for pid, s in samples.items() if s["category"] == category}
                figs["speedup_ci95"] = speedup_ci(bootstrap, base, mine) if base else None
                figs["mean_acceptance_length_ci95"] = acceptance_length_ci(bootstrap, mine)
                figs["too_few_prompts"] = len(mine) < min_prompts


def rank(level: dict[str, Any]) -> tuple[float, float]:
    """How levels rank before noise is considered: speedup, then acceptance length."""
    length = (level["acceptance"] or {}).get("mean_acceptance_length") or 0
    return level.get("speedup") or 0, length


def choose_k(
    options: list[tuple[int | None, dict[str, Any]]], bootstrap: Bootstrap
) -> tuple[int | None, dict[str, Any]]:
    """Of one drafter's levels at one concurrency (k, level), the k to use and the record of
    the choice. The best speedup (ties: acceptance length) wins only when its lead over every
    smaller k is beyond the noise; else the smallest k within the noise of it. Without speedups
    (a deployment measured as it runs), the best acceptance length."""

    best_k, best = max(options, key=lambda option: rank(option[1]))
    choice: dict[str, Any] = {"best_k": best_k, "k": best_k, "compared": []}
    if best.get("speedup") is None:
        return best_k, choice
    for k, level in sorted((o for o in options if o[0] < best_k), key=lambda o: o[0]):
        if not level.get("speedup"):
            continue
        lead = speedup_ci(bootstrap, level["samples"], best["samples"])
        beyond = lead is not None and lead[0] > 1
        choice["compared"].append(
            {
                "k": k,
                "best_over_k_speedup": best["speedup"] / level["speedup"],
                "ci95": lead,
                "beyond_noise": beyond,
            }
        )
        if not beyond:
            choice["k"] = k
            return k, choice
    return best_k, choice
