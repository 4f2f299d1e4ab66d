"""Analysis of the measured runs: speedups, the headline, the per-category table, results.

Pure functions of the runs (no server, no files). The headline is our EAGLE-3 (or served)
drafter at batch size 1 (a reference drafter's only when eval measured nothing of ours), at the
k :func:`eval.intervals.choose_k` takes: the best speedup only when its lead is beyond the
noise, else the smaller k. It is set beside ngram and each reference drafter at its k, with its
95% intervals and the k to use at each measured concurrency; ``eval.concurrency`` always
includes 1 (the profile refuses it otherwise).
"""

from __future__ import annotations

from typing import Any

from eval import lossless_lm_eval
from eval.intervals import Bootstrap, choose_k, rank
from eval.prompts import EvalPrompt, eval_data_revision
from pipeline.core.config import Profile


def ratio(base_tpot: float | None, figs: dict[str, Any]) -> float | None:
    tpot = figs["time_per_output_token_s"]
    return base_tpot / tpot if base_tpot and tpot else None


def batch_size_one(run: dict[str, Any]) -> dict[str, Any]:
    """The run's level at concurrency 1 (eval.concurrency always includes it)."""
    return next(lv for lv in run["levels"] if lv["concurrency"] == 1)


def headline(runs: list[dict[str, Any]], bootstrap: Bootstrap) -> dict[str, Any]:
    """Our EAGLE-3 (or served) drafter at concurrency 1, at the k :func:`choose_k` takes (the
    best reference drafter's when eval measured only those), with its 95% intervals, ngram's and
    each reference's figures at its k, and the k to use at each measured concurrency."""
    ours = [r for r in runs if r["method"] in ("eagle3", "served") and not r["reference"]]
    candidates = ours or [r for r in runs if r["reference"]]
    series = max(
        dict.fromkeys(r["series"] for r in candidates),
        key=lambda name: max(rank(batch_size_one(r)) for r in candidates if r["series"] == name),
    )
    mine = [r for r in candidates if r["series"] == series]
    k, choice = choose_k([(r["k"], batch_size_one(r)) for r in mine], bootstrap)
    run = next(r for r in mine if r["k"] == k)
    level = batch_size_one(run)
    summary = {
        "method": run["method"],
        "series": run["series"],
        "concurrency": 1,
        "prompts": level["prompts"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "time_per_output_token_s": level["time_per_output_token_s"],
        **level["acceptance"],
        "mean_acceptance_length_ci95": level.get("mean_acceptance_length_ci95"),
        "k_choice": choice,
    }
    if "speedup" in level:
        baseline = next(r for r in runs if r["method"] == "baseline")
        base = batch_size_one(baseline)
        summary["baseline_time_per_output_token_s"] = base["time_per_output_token_s"]
        summary["speedup"] = level["speedup"]
        summary["speedup_ci95"] = level.get("speedup_ci95")
        if "per_repeat" in level:
            summary["speedup_per_repeat"] = [r["speedup"] for r in level["per_repeat"]]
        summary["greedy_outputs_identical"] = not level["mismatched_prompt_ids"]
        summary["mismatched_prompt_ids"] = level["mismatched_prompt_ids"]
        summary["k_by_concurrency"] = k_by_concurrency(mine, bootstrap)
        summary["k_advice"] = k_advice(summary["k_by_concurrency"])
    if "sampled" in run:
        summary["sampled"] = sampled_summary(run["sampled"])
    ngram = next((r for r in runs if r["method"] == "ngram" and r["k"] == run["k"]), None)
    if ngram is not None:
        ngram_level = batch_size_one(ngram)
        length = (ngram_level["acceptance"] or {}).get("mean_acceptance_length")
        summary["ngram_mean_acceptance_length"] = length
        summary["eagle3_over_ngram_acceptance_length"] = (
            summary["mean_acceptance_length"] / length if length else None
        )
    names = dict.fromkeys(
        r["reference"] for r in runs if r["reference"] and r["reference"] != run["reference"]
    )
    if names:
        summary["references"] = {
            name: versus(summary, closest(runs, name, run["k"])) for name in names
        }
    return summary


def sampled_summary(level: dict[str, Any]) -> dict[str, Any]:
    """The headline arm at deployment sampling: acceptance and speedup with their intervals, and
    the distribution test against no speculation."""
    acc = level["acceptance"] or {}
    return {
        **level["sampling"],
        "concurrency": level["concurrency"],
        "acceptance_rate": acc.get("acceptance_rate"),
        "mean_acceptance_length": acc.get("mean_acceptance_length"),
        "mean_acceptance_length_ci95": level.get("mean_acceptance_length_ci95"),
        "per_position_acceptance": acc.get("per_position_acceptance"),
        "speedup": level.get("speedup"),
        "speedup_ci95": level.get("speedup_ci95"),
        "distribution": level.get("distribution"),
    }


def k_by_concurrency(mine: list[dict[str, Any]], bootstrap: Bootstrap) -> list[dict[str, Any]]:
    """At each measured concurrency, the k :func:`choose_k` takes for this drafter, its speedup
    and interval, and whether it pays: its interval lies above 1 (its point, without one)."""
    rows = []
    for concurrency in sorted(lv["concurrency"] for lv in mine[0]["levels"]):
        options = [
            (r["k"], next(lv for lv in r["levels"] if lv["concurrency"] == concurrency))
            for r in mine
        ]
        k, _ = choose_k(options, bootstrap)
        level = dict(options)[k]
        ci = level.get("speedup_ci95")
        rows.append(
            {
                "concurrency": concurrency,
                "k": k,
                "speedup": level["speedup"],
                "speedup_ci95": ci,
                "pays": (ci[0] if ci else level["speedup"] or 0) > 1,
            }
        )
    return rows


def k_advice(rows: list[dict[str, Any]]) -> str:
    """The card's "k to use up to concurrency N" line, from :func:`k_by_concurrency`."""
    groups: list[tuple[int | None, list[int]]] = []
    for row in rows:
        use = row["k"] if row["pays"] else None
        if groups and groups[-1][0] == use:
            groups[-1][1].append(row["concurrency"])
        else:
            groups.append((use, [row["concurrency"]]))
    measured_at = ", ".join(str(r["concurrency"]) for r in rows)
    if all(use is None for use, _ in groups):
        return (
            f"no k was measured faster than no speculation beyond the noise at any measured "
            f"concurrency ({measured_at}): serve this verifier without speculation."
        )
    parts = []
    for use, levels in groups:
        if use is not None and not parts:
            parts.append(f"k={use} up to concurrency {levels[-1]}")
        elif use is not None and len(levels) == 1:
            parts.append(f"k={use} at concurrency {levels[0]}")
        elif use is not None:
            parts.append(f"k={use} from concurrency {levels[0]} up to {levels[-1]}")
        else:
            at = ", ".join(map(str, levels))
            parts.append(
                f"no speculation at concurrency {at}, where no k was faster beyond the noise"
            )
    return f"{'; '.join(parts)}. Measured at concurrency {measured_at}."


def closest(runs: list[dict[str, Any]], reference: str, k: int) -> dict[str, Any]:
    """A reference drafter's run at ``k``, else (measured at other k only) its best at batch
    size 1."""
    mine = [r for r in runs if r["reference"] == reference]
    same = [r for r in mine if r["k"] == k]
    if same:
        return same[0]
    return max(mine, key=lambda r: batch_size_one(r).get("speedup") or 0)


def versus(summary: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A reference drafter at batch size 1 (at the headline's k when measured there), and the
    headline over it."""
    level = batch_size_one(reference)
    length = level["acceptance"]["mean_acceptance_length"]
    speedup = level.get("speedup")
    return {
        "k": reference["k"],
        "mean_acceptance_length": length,
        "acceptance_rate": level["acceptance"]["acceptance_rate"],
        "speedup": speedup,
        "headline_over_reference_acceptance_length": summary["mean_acceptance_length"] / length,
        "headline_over_reference_speedup": (
            summary["speedup"] / speedup if speedup and summary.get("speedup") else None
        ),
    }


CATEGORY_FIGURES = (
    "mean_acceptance_length",
    "mean_acceptance_length_ci95",
    "speedup",
    "speedup_ci95",
)


def per_category_table(runs: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Each category's acceptance length and speedup, with their intervals, for every drafter
    (series) at ``k``, batch size 1; whether it has too few prompts to say anything."""
    table: dict[str, Any] = {}
    for run in runs:
        if run["k"] != k:
            continue
        level = batch_size_one(run)
        for cat, figs in level.get("per_category", {}).items():
            row = table.setdefault(
                cat,
                {
                    "prompts": figs["prompts"],
                    "too_few_prompts": figs.get("too_few_prompts"),
                    **{key: {} for key in CATEGORY_FIGURES},
                },
            )
            row["mean_acceptance_length"][run["series"]] = (figs["acceptance"] or {}).get(
                "mean_acceptance_length"
            )
            for key in CATEGORY_FIGURES[1:]:
                row[key][run["series"]] = figs.get(key)
    return table


def build_results(
    profile: Profile,
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    *,
    prompts: list[EvalPrompt],
    skipped: dict[str, Any],
    lm_scores: dict[str, Any],
    drafter: str | None,
    verifier: str,
    references: dict[str, Any],
) -> dict[str, Any]:
    """``results.json`` but its plots: what was measured, on which prompts, the headline
    (``summary``), every run, lm-eval's comparison (when both arms were scored) and the
    per-category table at the headline's k."""
    results: dict[str, Any] = {
        "drafter": drafter,
        "verifier": verifier,
        "prompts": {"count": len(prompts), **eval_data_revision(profile), "skipped": skipped},
        "summary": summary,
        "runs": runs,
    }
    if references:
        results["reference_drafters"] = references
    if len(lm_scores) == 2:
        results["lm_eval"] = lossless_lm_eval.compare(lm_scores["baseline"], lm_scores["eagle3"])
    results["per_category"] = per_category_table(runs, summary["num_speculative_tokens"])
    return results
