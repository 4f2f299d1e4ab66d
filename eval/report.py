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


def interval(ci: list[float] | None, spec: str = ".3f") -> str:
    """The text of a 95% interval, ' [low, high]'; '' without one."""
    return "" if not ci else f" [{format(ci[0], spec)}, {format(ci[1], spec)}]"


def headline_lines(s: dict[str, Any]) -> list[str]:
    """The headline with its intervals, why its k was taken, and the k to use by concurrency."""
    k = s["num_speculative_tokens"]
    speedup = ""
    if s.get("speedup") is not None:
        speedup = f", speedup {fmt(s['speedup'], '.2f')}x{interval(s.get('speedup_ci95'), '.2f')}"
    lines = [
        f"Headline: {s['series']} k={k}, batch size 1: acceptance rate "
        f"{fmt(s['acceptance_rate'])}, mean acceptance length {fmt(s['mean_acceptance_length'])}"
        f"{interval(s.get('mean_acceptance_length_ci95'))}{speedup} (95% bootstrap intervals "
        "over prompts in brackets).",
        "",
    ]
    if s.get("speedup_per_repeat"):
        each = ", ".join(fmt(v, ".2f") for v in s["speedup_per_repeat"])
        lines += [f"Speedup in each repeat: {each}.", ""]
    choice = s.get("k_choice") or {}
    for c in choice.get("compared", []):
        verdict = "beyond" if c["beyond_noise"] else "within"
        lines.append(
            f"k={choice['best_k']} over k={c['k']}: {fmt(c['best_over_k_speedup'], '.3f')}x"
            f"{interval(c['ci95'])}, {verdict} the noise."
        )
    if choice.get("compared"):
        lines += [f"The headline takes k={choice['k']}.", ""]
    if s.get("k_advice"):
        lines += [f"k to use by load: {s['k_advice']}", ""]
    return lines


def sampled_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Every arm at deployment sampling, and the distribution test against no speculation."""
    sampled = [r for r in runs if "sampled" in r]
    if not sampled:
        return []
    first = sampled[0]["sampled"]
    s = first["sampling"]
    lines = [
        "",
        f"At deployment sampling (temperature {s['temperature']}, top_p {s['top_p']}, "
        f"{s['replies_per_prompt']} replies per prompt with their own seeds, the same in every "
        f"arm; concurrency {first['concurrency']}). Replies differ from the baseline's by design; "
        "a stratified permutation test compares their distributions (reply length, token "
        "frequencies; p-values, Bonferroni):",
        "",
        "| arm | k | acceptance rate | mean acceptance length | speedup | reply tokens (baseline) "
        "| p length | p tokens | indistinguishable |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sampled:
        if run["method"] == "baseline":
            continue
        lv = run["sampled"]
        acc, d = lv["acceptance"] or {}, lv.get("distribution") or {}
        tokens = d.get("mean_reply_tokens", {})
        verdict = "-" if not d else ("yes" if d["indistinguishable"] else "NO")
        lines.append(
            f"| {run['series']} | {run['k'] or '-'} | {fmt(acc.get('acceptance_rate'))} "
            f"| {fmt(acc.get('mean_acceptance_length'))}"
            f"{interval(lv.get('mean_acceptance_length_ci95'))} "
            f"| {fmt(lv.get('speedup'), '.2f')}{interval(lv.get('speedup_ci95'), '.2f')} "
            f"| {fmt(tokens.get('drafter'), '.1f')} ({fmt(tokens.get('baseline'), '.1f')}) "
            f"| {fmt(d.get('length_p_value'))} | {fmt(d.get('token_frequency_p_value'))} "
            f"| {verdict} |"
        )
    return lines


def results_markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = [
        *headline_lines(s),
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
                f"| {fmt(acc.get('acceptance_rate'))} | {fmt(acc.get('mean_acceptance_length'))}"
                f"{interval(lv.get('mean_acceptance_length_ci95'))} "
                f"| {fmt(lv['output_tokens_per_s'], '.1f')} "
                f"| {fmt((lv['time_per_output_token_s'] or 0) * 1000, '.2f')} "
                f"| {fmt(lv.get('speedup'), '.2f')}{interval(lv.get('speedup_ci95'), '.2f')} "
                f"| {identical} |"
            )
    lines += sampled_lines(results["runs"])
    per_cat = results.get("per_category", {})
    if per_cat:
        methods = sorted({m for c in per_cat.values() for m in c["mean_acceptance_length"]})
        lines += [
            "",
            f"Per category at k={s['num_speculative_tokens']}, batch size 1 (* too few prompts "
            "to say anything):",
            "",
            "| category | prompts | "
            + " | ".join(f"{m} acceptance length | {m} speedup" for m in methods)
            + " |",
            "|---|---|" + "---|---|" * len(methods),
        ]
        for cat, c in sorted(per_cat.items()):
            cells = " | ".join(
                f"{fmt(c['mean_acceptance_length'].get(m))}"
                f"{interval(c.get('mean_acceptance_length_ci95', {}).get(m))} "
                f"| {fmt(c['speedup'].get(m), '.2f')}"
                f"{interval(c.get('speedup_ci95', {}).get(m), '.2f')}"
                for m in methods
            )
            star = "*" if c.get("too_few_prompts") else ""
            lines.append(f"| {cat}{star} | {c['prompts']} | {cells} |")
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
    samples: dict[str, dict[str, Any]],
    *,
    deployed: bool,
) -> None:
    """The plots (listed in ``results["plots"]``; no speedup plots for a deployment, which has
    no baseline), then ``outputs.json``, ``samples.json``, ``results.json`` and ``results.md``
    in ``folder``; logs the headline."""
    runs, summary = results["runs"], results["summary"]
    k = summary["num_speculative_tokens"]
    drafted = [
        {"method": r["method"], "series": r["series"], "k": r["k"] or k, **batch_size_one(r),
         "sampled": r.get("sampled")}
        for r in runs
        if r["method"] != "baseline" and (batch_size_one(r)["acceptance"] or {}).get("drafts")
    ]  # fmt: skip
    results["plots"] = [
        plots.per_position(drafted, folder / "acceptance_per_position.png"),
        plots.acceptance_length_by_k(drafted, folder / "acceptance_length_by_k.png"),
    ]
    if not deployed:
        results["plots"] += [
            plots.speedup_by_category(
                results["per_category"], k, folder / "speedup_by_category.png"
            ),
            plots.speedup_by_concurrency(
                [{**r, "k": r["k"] or k} for r in runs if r["method"] != "baseline"],
                folder / "speedup_by_concurrency.png",
            ),
        ]
    atomic_write_json(folder / "outputs.json", outputs)
    atomic_write_json(folder / "samples.json", samples)
    # Published: paths relative to the run folder, none of this machine's (pipeline.core.portable).
    atomic_write_json(folder / "results.json", portable(profile, results))
    atomic_write_bytes(folder / "results.md", results_markdown(results).encode())
    log.info(
        "eval: %s k=%d: acceptance rate %.3f, mean acceptance length %.3f%s (ngram %s), "
        "speedup %s%s",
        summary["series"],
        k,
        summary["acceptance_rate"],
        summary["mean_acceptance_length"],
        interval(summary.get("mean_acceptance_length_ci95")),
        fmt(summary.get("ngram_mean_acceptance_length")),
        fmt(summary.get("speedup"), ".2f"),
        interval(summary.get("speedup_ci95"), ".2f"),
    )
