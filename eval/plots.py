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


def acceptance_length_by_k(arms: list[dict[str, Any]], path: Path) -> dict[str, str]:
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    every = list(dict.fromkeys(a["series"] for a in arms))
    for series in every:
        mine = sorted((a for a in arms if a["series"] == series), key=lambda a: a["k"])
        ks = [a["k"] for a in mine]
        lengths = [a["acceptance"]["mean_acceptance_length"] for a in mine]
        ax.plot(ks, lengths, marker="o", color=color(series, every), label=series)
        for k, length in zip(ks, lengths, strict=True):
            ax.annotate(f"{length:.2f}", (k, length), fontsize=7, xytext=(0, 4),
                        textcoords="offset points", ha="center")  # fmt: skip
    ax.set_xlabel("draft tokens per step (k)")
    ax.set_ylabel("mean acceptance length")
    ax.set_xticks(sorted({a["k"] for a in arms}))
    ax.set_title("Mean acceptance length by k (batch size 1)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, "Acceptance length by k")


def speedup_by_category(
    categories: dict[str, dict[str, float | None]], k: int, path: Path
) -> dict[str, str]:
    """Grouped bars: each drafter's speedup per category at one k; 1.0 marks parity."""
    names = sorted(categories)
    methods = list(dict.fromkeys(m for c in categories.values() for m in c))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=120)
    for i, method in enumerate(methods):
        values = [categories[n].get(method) or 0 for n in names]
        ax.bar(
            [j + i * width for j in range(len(names))],
            values,
            width,
            color=color(method, methods),
            label=method,
        )
    ax.axhline(1.0, color="#555", linewidth=0.8, linestyle=":")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup (time per output token)")
    ax.set_title(f"Speedup by category (k={k}, batch size 1)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path, "Speedup by category")
