"""The eval plots the model card embeds (matplotlib, headless PNG), drawn from results.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"eagle3": "#3b6ea8", "served": "#3b6ea8", "ngram": "#c2703d"}
# Reference drafters, in the order eval lists them.
REFERENCE_COLORS = ("#4f9a5b", "#8a5aa8", "#a8a23b", "#5a5a5a")


def color(series: str, every: list[str]) -> str:
    """Our arms' fixed colours; each reference drafter its own."""
    if series in COLORS:
        return COLORS[series]
    references = [s for s in every if s not in COLORS]
    return REFERENCE_COLORS[references.index(series) % len(REFERENCE_COLORS)]


def _save(fig, path: Path, title: str) -> dict[str, str]:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"file": path.name, "title": title}


def per_position(arms: list[dict[str, Any]], path: Path) -> dict[str, str]:
    """Acceptance at each draft position, one line per (drafter, k), at concurrency 1."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=120)
    every = list(dict.fromkeys(a["series"] for a in arms))
    for arm in arms:
        rates = arm["acceptance"]["per_position_acceptance"]
        style = "--" if arm["method"] == "ngram" else "-"
        ax.plot(
            range(1, len(rates) + 1),
            rates,
            style,
            marker="o",
            color=color(arm["series"], every),
            alpha=0.35 + 0.65 * arm["k"] / max(a["k"] for a in arms),
            label=f"{arm['series']} k={arm['k']}",
        )
    ax.set_xticks(range(1, max(a["k"] for a in arms) + 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Per-position acceptance (batch size 1, greedy)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path, "Per-position acceptance")


def error_bars(values: list[float | None], intervals: list[list[float] | None]) -> list[list]:
    """Matplotlib's yerr (distances below and above each value) from 95% intervals; 0 where a
    value has none."""
    below, above = [], []
    for value, ci in zip(values, intervals, strict=True):
        below.append(max(value - ci[0], 0) if value is not None and ci else 0)
        above.append(max(ci[1] - value, 0) if value is not None and ci else 0)
    return [below, above]


def acceptance_length_by_k(arms: list[dict[str, Any]], path: Path) -> dict[str, str]:
    """Each drafter's mean acceptance length at each k, greedy at batch size 1, and at
    deployment sampling (dotted) where measured, with 95% intervals."""
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    every = list(dict.fromkeys(a["series"] for a in arms))
    for series in every:
        mine = sorted((a for a in arms if a["series"] == series), key=lambda a: a["k"])
        ks = [a["k"] for a in mine]
        lengths = [a["acceptance"]["mean_acceptance_length"] for a in mine]
        yerr = error_bars(lengths, [a.get("mean_acceptance_length_ci95") for a in mine])
        ax.errorbar(ks, lengths, yerr=yerr, marker="o", capsize=3, color=color(series, every),
                    label=series)  # fmt: skip
        for k, length in zip(ks, lengths, strict=True):
            ax.annotate(f"{length:.2f}", (k, length), fontsize=7, xytext=(6, 4),
                        textcoords="offset points", ha="left")  # fmt: skip
        sampled = [
            a
            for a in mine
            if ((a.get("sampled") or {}).get("acceptance") or {}).get("mean_acceptance_length")
        ]
        if sampled:
            values = [a["sampled"]["acceptance"]["mean_acceptance_length"] for a in sampled]
            cis = [a["sampled"].get("mean_acceptance_length_ci95") for a in sampled]
            ax.errorbar([a["k"] for a in sampled], values, yerr=error_bars(values, cis),
                        fmt=":", marker="s", capsize=3, color=color(series, every), alpha=0.7,
                        label=f"{series}, sampled")  # fmt: skip
    ax.set_xlabel("draft tokens per step (k)")
    ax.set_ylabel("mean acceptance length")
    ax.set_xticks(sorted({a["k"] for a in arms}))
    ax.set_title("Mean acceptance length by k (greedy at batch size 1; sampled dotted)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, "Acceptance length by k")


def speedup_by_category(
    categories: dict[str, dict[str, Any]], k: int, path: Path
) -> dict[str, str]:
    """Grouped bars: each drafter's speedup per category at one k, with 95% intervals; 1.0 marks
    parity, and a category with too few prompts to say anything is starred and hatched."""
    names = sorted(categories)
    methods = list(dict.fromkeys(m for c in categories.values() for m in c["speedup"]))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=120)
    for i, method in enumerate(methods):
        values = [categories[n]["speedup"].get(method) or 0 for n in names]
        intervals = [categories[n].get("speedup_ci95", {}).get(method) for n in names]
        bars = ax.bar(
            [j + i * width for j in range(len(names))],
            values,
            width,
            yerr=error_bars(values, intervals),
            capsize=2,
            color=color(method, methods),
            label=method,
        )
        for bar, name in zip(bars, names, strict=True):
            if categories[name].get("too_few_prompts"):
                bar.set_hatch("//")
    ax.axhline(1.0, color="#555", linewidth=0.8, linestyle=":")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(names))])
    labels = [n + ("*" if categories[n].get("too_few_prompts") else "") for n in names]
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup (time per output token)")
    title = f"Speedup by category (k={k}, batch size 1, 95% intervals)"
    if any(categories[n].get("too_few_prompts") for n in names):
        title += "\n* hatched: too few prompts to say anything"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, "Speedup by category")


def speedup_by_concurrency(arms: list[dict[str, Any]], path: Path) -> dict[str, str]:
    """Speedup against concurrency, one line per (drafter, k), with 95% intervals: speculative
    speedup shrinks as the batch fills the verifier's step; below the dotted 1.0 it costs."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=120)
    every = list(dict.fromkeys(a["series"] for a in arms))
    k_max = max(a["k"] for a in arms)
    for arm in arms:
        levels = sorted(arm["levels"], key=lambda lv: lv["concurrency"])
        values = [lv.get("speedup") for lv in levels]
        ax.errorbar(
            [lv["concurrency"] for lv in levels],
            [v or 0 for v in values],
            yerr=error_bars(values, [lv.get("speedup_ci95") for lv in levels]),
            fmt="--" if arm["method"] == "ngram" else "-",
            marker="o",
            capsize=3,
            color=color(arm["series"], every),
            alpha=0.35 + 0.65 * arm["k"] / k_max,
            label=f"{arm['series']} k={arm['k']}",
        )
    ax.axhline(1.0, color="#555", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    concurrencies = sorted({lv["concurrency"] for a in arms for lv in a["levels"]})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup (time per output token)")
    ax.set_title("Speedup by concurrency (95% intervals)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path, "Speedup by concurrency")
