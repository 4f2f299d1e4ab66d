"""Stage `data_curve`: how much data is enough, answered with a curve instead of a guess.

Run as: python -m pipeline.data_curve --config configs/smollm2-135m.yaml   (make data-curve)

Reads `verifier`, `extract` (the prepared data every point trains on), `train` and `eval` (the
k of its headline, vLLM's ngram drafter at that k, the line a drafter must clear, and this
run's drafter on all of the data). For each budget of
``data_curve.train_tokens`` it trains a drafter on that many tokens of extract's training split
(``train.max_train_tokens``, :mod:`pipeline.training.token_budget`) and measures it in vLLM at
batch size 1 against the verifier alone, on eval's prompts (where eval measured ngram's line),
by running the `train` and `eval` stages themselves on a point run of its own,
``data_curve/tokens-<N>/`` (:mod:`pipeline.training.point_runs`). Writes ``curve.json``,
``curve.png`` (mean acceptance length and speedup against training tokens, ngram's as a line)
and ``manifest.json``; the card embeds the plot.

Invariants:
- every point trains on the leading rows of the same split with the same validation rows, the
  same epochs, learning rate, draft vocabulary size and seed: only the data grows;
- a budget beyond the extracted data is recorded as not reached, with the training rows it
  would take, and the data's whole training split is measured once as its own point: this
  run's own drafter and eval (the same recipe on the same rows), not trained again, when its
  train config is the profile's and eval measured it at k (run ``.`` in the record);
- points are kept, resumed and started over as point runs are (a changed recipe, k or
  prompts, or training stale over this run's data, trains the point again);
- a profile without a ``data_curve`` section has nothing to measure and writes nothing.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json, save_figure_atomically
from pipeline.core.config import DataCurveConfig, Profile
from pipeline.core.contracts import DataCurveOutputs, TrainOutputs
from pipeline.core.manifest import all_succeeded, now, stage_dir, write_manifest
from pipeline.core.progress import progress
from pipeline.training.point_runs import (
    arm_at,
    measure_point,
    measured,
    measured_point,
    own_recipe,
    point_profile,
    prepare_point,
    read_sweep_base,
)
from pipeline.training.token_budget import TrainingData, select, split_lengths

log = logging.getLogger(__name__)
PLOT = "curve.png"


def budgets(
    curve: DataCurveConfig, seq_lens: list[int], supervised: list[int], ratio: float
) -> tuple[list[TrainingData], list[dict[str, Any]]]:
    """The points to train (each a distinct selection of rows) and the budgets not reached."""
    points: list[TrainingData] = []
    unreached = []
    for tokens in curve.train_tokens:
        record = select(seq_lens, supervised, ratio, tokens)[1]
        if record.whole and record.tokens < tokens:
            per_row = record.tokens / record.rows
            unreached.append(
                {
                    "train_tokens": tokens,
                    "available_tokens": record.tokens,
                    "more_training_rows": math.ceil((tokens - record.tokens) / per_row),
                }
            )
        if not points or points[-1].rows != record.rows:
            points.append(record)
    return points, unreached


def budget_profile(profile: Profile, record: TrainingData, k: int) -> Profile:
    """The profile of one point: this run's, on a budget, measured at k at batch size 1."""
    return point_profile(
        profile, "data_curve", point_name(record), {"max_train_tokens": record.tokens}, k
    )


def point_name(record: TrainingData) -> str:
    return f"tokens-{record.tokens}"


def curve_point(
    name: str, record: TrainingData, k: int, train: TrainOutputs, results: dict[str, Any]
) -> dict[str, Any]:
    """One point of the curve: its budget's rows and tokens, and what was measured."""
    point = measured(name, k, train, results)
    return {"run": name, "train_tokens": record.tokens, **point, "training_data": record.record()}


def plot(points: list[dict[str, Any]], ngram: dict[str, Any] | None, k: int, path: Path) -> None:
    """Mean acceptance length and speedup against training tokens; ngram's as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [p["train_tokens"] for p in points]
    fig, (length, speed) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    panels = ((length, "mean_acceptance_length", "mean acceptance length"), (speed, "speedup", ""))
    for ax, key, label in panels:
        ax.plot(tokens, [p[key] for p in points], "o-", color="#3b6ea8", label=f"EAGLE-3, k={k}")
        if ngram and ngram.get(key) is not None:
            ax.axhline(ngram[key], ls="--", color="#c2703d", label=f"ngram, k={k}")
        if key == "speedup":
            ax.axhline(1.0, ls=":", color="#5a5a5a", label="no speculation")
        ax.set_xscale("log")
        ax.set_xticks(tokens, labels=[f"{t / 1000:.0f}K" for t in tokens])
        ax.minorticks_off()
        ax.set_xlabel("training tokens")
        ax.set_ylabel(label or "speedup at batch size 1 (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("How much data: the drafter against its training tokens", fontsize=10)
    save_figure_atomically(fig, path)


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    curve = profile.data_curve
    if curve is None:  # hero-run asks every profile; this one wants no curve
        log.info("data curve: the profile has no data_curve section, nothing to measure")
        return {"stage": "data_curve", "counts": {"skipped": "no data_curve section"}}
    this_run = read_sweep_base(profile, "data_curve", curve.num_speculative_tokens)
    extract, own, k, results = this_run.extract, this_run.train, this_run.k, this_run.results
    # The whole data's point is this run's drafter when it was trained on this recipe.
    whole_is_own = own_recipe(profile, own)
    prepared = stage_dir(profile, "extract") / extract.outputs.prepared
    todo, unreached = budgets(curve, *split_lengths(prepared), profile.train.train_data_ratio)
    folder = stage_dir(profile, "data_curve")
    folder.mkdir(parents=True, exist_ok=True)
    points = []
    bar = progress(total=len(todo), desc="data curve", unit="point")
    with bar:
        for record in todo:
            if record.whole and whole_is_own and arm_at(results, "eagle3", k):
                # This run's own drafter: the same recipe on all of the data, measured by eval.
                points.append(curve_point(".", record, k, own.outputs, results))
            else:
                point = budget_profile(profile, record, k)
                config = prepare_point(profile, point)
                log.info("data curve: %s", point.run.name)
                measure_point(point, config, f"the data curve's point {point.run.name}")
                points.append(curve_point(point.run.name, record, k, *measured_point(point)))
            bar.update(1)
    ngram = arm_at(results, "ngram", k)
    plot(points, ngram, k, folder / PLOT)
    curve_record = {"k": k, "points": points, "not_reached": unreached, "ngram": ngram}
    atomic_write_json(folder / "curve.json", curve_record)
    return write_manifest(
        profile,
        "data_curve",
        started_at=started,
        counts=all_succeeded(len(points)),
        outputs=DataCurveOutputs(
            curve="curve.json",
            plot=PLOT,
            k=k,
            points=[{key: p[key] for key in CURVE_KEYS} for p in points],
            not_reached=unreached,
            ngram=ngram,
        ),
        data_revision=extract.data_revision,
    )


CURVE_KEYS = ("run", "train_tokens", "mean_acceptance_length", "speedup", "acceptance_rate")


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("data_curve", run, argv)


if __name__ == "__main__":
    main()
