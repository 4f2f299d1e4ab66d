"""Analysis of the measured runs: speedups, the headline, the per-category table, results.

Pure functions of the runs (no server, no files). The headline is our EAGLE-3 (or served) arm
at batch size 1 with the best speedup, ties broken by acceptance length (a reference drafter's
only when eval measured nothing of ours), set beside ngram and each reference drafter at its k;
``eval.concurrency`` always includes 1 (the profile refuses it otherwise).
"""

from __future__ import annotations

from typing import Any

from eval import lossless_lm_eval
from eval.prompts import EvalPrompt, eval_data_revision
from pipeline.core.config import Profile


def ratio(base_tpot: float | None, figs: dict[str, Any]) -> float | None:
    tpot = figs["time_per_output_token_s"]
    return base_tpot / tpot if base_tpot and tpot else None


def batch_size_one(run: dict[str, Any]) -> dict[str, Any]:
    """The run's level at concurrency 1 (eval.concurrency always includes it)."""
    return next(lv for lv in run["levels"] if lv["concurrency"] == 1)


def headline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Our EAGLE-3 (or served) arm at concurrency 1 with the best speedup (the best reference
    drafter's when eval measured only those), with ngram's and each reference's at its k."""
    candidates = [r for r in runs if r["method"] in ("eagle3", "served") and not r["reference"]]
    at_one = [(r, batch_size_one(r)) for r in candidates or [r for r in runs if r["reference"]]]
    run, level = max(
        at_one,
        key=lambda rl: (rl[1].get("speedup") or 0, rl[1]["acceptance"]["mean_acceptance_length"]),
    )
    summary = {
        "method": run["method"],
        "series": run["series"],
        "concurrency": 1,
        "prompts": level["prompts"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "time_per_output_token_s": level["time_per_output_token_s"],
        **level["acceptance"],
    }
    if "speedup" in level:
        baseline = next(r for r in runs if r["method"] == "baseline")
        base = batch_size_one(baseline)
        summary["baseline_time_per_output_token_s"] = base["time_per_output_token_s"]
        summary["speedup"] = level["speedup"]
        summary["greedy_outputs_identical"] = not level["mismatched_prompt_ids"]
        summary["mismatched_prompt_ids"] = level["mismatched_prompt_ids"]
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


def per_category_table(runs: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Each category's acceptance length and speedup for every drafter (series) at ``k``,
    batch size 1."""
    table: dict[str, Any] = {}
    for run in runs:
        if run["k"] != k:
            continue
        level = batch_size_one(run)
        for cat, figs in level.get("per_category", {}).items():
            row = table.setdefault(
                cat, {"prompts": figs["prompts"], "mean_acceptance_length": {}, "speedup": {}}
            )
            row["mean_acceptance_length"][run["series"]] = (figs["acceptance"] or {}).get(
                "mean_acceptance_length"
            )
            row["speedup"][run["series"]] = figs.get("speedup")
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
