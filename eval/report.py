"""Writing eval's results: the plots, ``outputs.json``, ``results.json`` and ``results.md``.

``results.json`` is published: its paths are relative to the run folder
(:func:`pipeline.core.portable.portable`), none of this machine's. ``results.md`` is the same
numbers as tables, "-" where a figure does not apply (the baseline's acceptance, a deployment's
speedup). The plots are drawn by :mod:`eval.plots` from the batch-size-1 level of every arm
that drafted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eval import plots
from eval.summary import batch_size_one
from pipeline.core.atomic_files import atomic_write_bytes, atomic_write_json
from pipeline.core.config import Profile
from pipeline.core.portable import portable

log = logging.getLogger(__name__)


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def reference_lines(results: dict[str, Any]) -> list[str]:
    """The reference drafters beside the headline, at its k and batch size 1."""
    s, sources = results["summary"], results.get("reference_drafters", {})
    if not s.get("references"):
        return []
    lines = [
        f"Reference drafters at batch size 1 (at k={s['num_speculative_tokens']} where measured "
        f"there), against {s['series']} k={s['num_speculative_tokens']}:",
        "",
        "| reference | source | layout | k | mean acceptance length | speedup "
        f"| {s['series']} / reference (acceptance length) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in s["references"].items():
        src = sources.get(name, {})
        layout = src.get("layout", "-") + (", converted" if src.get("converted") else "")
        lines.append(
            f"| {name} | {src.get('source', '-')} | {layout} | {r['k']} "
            f"| {fmt(r['mean_acceptance_length'])} | {fmt(r['speedup'], '.2f')} "
            f"| {fmt(r['headline_over_reference_acceptance_length'], '.2f')} |"
        )
    return [*lines, ""]


def results_markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = [
        f"Headline: {s['series']} k={s['num_speculative_tokens']}, batch size 1: acceptance "
        f"rate {fmt(s['acceptance_rate'])}, mean acceptance length "
        f"{fmt(s['mean_acceptance_length'])}, speedup {fmt(s.get('speedup'), '.2f')}x.",
        "",
        *reference_lines(results),
        "| arm | k | concurrency | acceptance rate | mean acceptance length | output tok/s "
        "| ms / output token | speedup | greedy outputs identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        for lv in run["levels"]:
            acc = lv["acceptance"] or {}
            mismatched = lv.get("mismatched_prompt_ids")
            identical = "-" if mismatched is None else "yes"
            if mismatched:
                identical = f"no ({len(mismatched)})"
            lines.append(
                f"| {run['series']} | {run['k'] or '-'} | {lv['concurrency']} "
                f"| {fmt(acc.get('acceptance_rate'))} | {fmt(acc.get('mean_acceptance_length'))} "
                f"| {fmt(lv['output_tokens_per_s'], '.1f')} "
                f"| {fmt((lv['time_per_output_token_s'] or 0) * 1000, '.2f')} "
                f"| {fmt(lv.get('speedup'), '.2f')} | {identical} |"
            )
    per_cat = results.get("per_category", {})
    if per_cat:
        methods = sorted({m for c in per_cat.values() for m in c["mean_acceptance_length"]})
        lines += [
            "",
            f"Per category at k={s['num_speculative_tokens']}, batch size 1:",
            "",
            "| category | prompts | "
            + " | ".join(f"{m} acceptance length | {m} speedup" for m in methods)
            + " |",
            "|---|---|" + "---|---|" * len(methods),
        ]
        for cat, c in sorted(per_cat.items()):
            cells = " | ".join(
                f"{fmt(c['mean_acceptance_length'].get(m))} | {fmt(c['speedup'].get(m), '.2f')}"
                for m in methods
            )
            lines.append(f"| {cat} | {c['prompts']} | {cells} |")
    consistency = results.get("train_serve")
    if consistency and consistency["positions"]:
        lines += [
            "",
            f"Train/serve consistency at k={s['num_speculative_tokens']}, batch size 1: served "
            "acceptance per draft position against the drafter's validation accuracy "
            f"(below {consistency['min_ratio']}x is an error):",
            "",
            "| position | validation | served | served / validation |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['position']} | {fmt(r['validation'])} | {fmt(r['served'])} "
            f"| {fmt(r['ratio'], '.2f')} |"
            for r in consistency["positions"]
        ]
    skipped = results["prompts"].get("skipped") or {}
    if skipped.get("count"):
        per_category = ", ".join(f"{c} {n}" for c, n in sorted(skipped["per_category"].items()))
        lines += [
            "",
            f"Skipped {skipped['count']} prompts longer than {skipped['max_prompt_tokens']} tokens "
            f"(server.max_model_len - eval.max_tokens), by category: {per_category}.",
            "",
            "| skipped prompt | category | prompt tokens |",
            "|---|---|---|",
        ]
        lines += [
            f"| {p['id']} | {p['category']} | {p['prompt_tokens']} |" for p in skipped["prompts"]
        ]
    lossless = results.get("lm_eval")
    if lossless:
        lines += ["", "lm-eval (local-completions), with and without the drafter:", ""]
        lines += ["| task | documents | without | with | match |", "|---|---|---|---|---|"]
        for task, t in lossless["tasks"].items():
            without, with_ = (
                ", ".join(f"{name} {fmt(value)}" for name, value in sorted(scores.items()))
                for scores in (t["scores_without_drafter"], t["scores_with_drafter"])
            )
            lines.append(
                f"| {task} | {t['documents']} | {without} | {with_} "
                f"| {'yes' if t['scores_match'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def write_results(
    profile: Profile,
    folder: Path,
    results: dict[str, Any],
    outputs: dict[str, dict[str, Any]],
    *,
    deployed: bool,
) -> None:
    """The plots (listed in ``results["plots"]``; no speedup plot for a deployment, which has no
    baseline), then ``outputs.json``, ``results.json`` and ``results.md`` in ``folder``; logs
    the headline."""
    runs, summary = results["runs"], results["summary"]
    k = summary["num_speculative_tokens"]
    drafted = [
        {"method": r["method"], "series": r["series"], "k": r["k"] or k, **batch_size_one(r)}
        for r in runs
        if r["method"] != "baseline" and (batch_size_one(r)["acceptance"] or {}).get("drafts")
    ]
    results["plots"] = [
        plots.per_position(drafted, folder / "acceptance_per_position.png"),
        plots.acceptance_length_by_k(drafted, folder / "acceptance_length_by_k.png"),
    ]
    if not deployed:
        speedups = {c: row["speedup"] for c, row in results["per_category"].items()}
        results["plots"].append(
            plots.speedup_by_category(speedups, k, folder / "speedup_by_category.png")
        )
    atomic_write_json(folder / "outputs.json", outputs)
    # Published: paths relative to the run folder, none of this machine's (pipeline.core.portable).
    atomic_write_json(folder / "results.json", portable(profile, results))
    atomic_write_bytes(folder / "results.md", results_markdown(results).encode())
    log.info(
        "eval: %s k=%d: acceptance rate %.3f, mean acceptance length %.3f (ngram %s), speedup %s",
        summary["series"],
        k,
        summary["acceptance_rate"],
        summary["mean_acceptance_length"],
        fmt(summary.get("ngram_mean_acceptance_length")),
        fmt(summary.get("speedup"), ".2f"),
    )
