"""Stage `data_curve`: how much data is enough, answered with a curve instead of a guess.

Run as: python -m pipeline.data_curve --config configs/smollm2-135m.yaml   (make data-curve)

Reads `verifier`, `extract` (the prepared data every point trains on), `train` and `eval` (the
k of its headline, vLLM's ngram drafter at that k, the line a drafter must clear, and this
run's drafter on all of the data). For each budget of
``data_curve.train_tokens`` it trains a drafter on that many tokens of extract's training split
(``train.max_train_tokens``, :mod:`pipeline.training.token_budget`) and measures it in vLLM at
batch size 1 against the verifier alone, on eval's prompts (where eval measured ngram's line),
by running the `train` and `eval` stages themselves,
as subprocesses, on a point run of its own: ``data_curve/tokens-<N>/`` holds links to this
run's verifier, generate and extract folders, the point's profile, and its own train and eval
folders. Writes ``curve.json``, ``curve.png`` (mean acceptance length and speedup against
training tokens, ngram's as a line) and ``manifest.json``; the card embeds the plot.

Invariants:
- every point trains on the leading rows of the same split with the same validation rows, the
  same epochs, learning rate, draft vocabulary size and seed: only the data grows;
- a budget beyond the extracted data is recorded as not reached, with the training rows it
  would take, and the data's whole training split is measured once as its own point: this
  run's own drafter and eval (the same recipe on the same rows), not trained again, when its
  train config is the profile's and eval measured it at k (run ``.`` in the record);
- a finished point (its eval manifest fresh over its train, and both over this run's verifier
  and extract) is kept on a rerun; an unfinished one resumes where its train or eval stopped;
- a point whose profile changed (another recipe, k or prompts), or whose training is stale
  (this run's verifier, generate or extract rerun since), is trained again from the start;
- a profile without a ``data_curve`` section has nothing to measure and writes nothing;
- each point's train and eval run under the server guard, so they and their servers die with
  this stage however it ends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.atomic_files import atomic_write_bytes, atomic_write_json
from pipeline.core.config import DataCurveConfig, Profile
from pipeline.core.contracts import DataCurveOutputs, EvalOutputs, Manifest, TrainOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    all_succeeded,
    manifest_path,
    now,
    read_input,
    stage_dir,
    stage_manifest,
    write_manifest,
)
from pipeline.core.progress import progress
from pipeline.serving.logged_process import run_logged
from pipeline.training.token_budget import TrainingData, select, split_lengths

log = logging.getLogger(__name__)
# The stages a point run reads from this run, linked into its folder.
SHARED_STAGES = ("verifier", "generate", "extract")
PLOT = "curve.png"


class DataCurveError(PipelineError):
    """A point of the curve could not be trained or measured."""


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


def point_profile(profile: Profile, record: TrainingData, k: int) -> Profile:
    """The profile of one point: this run's, on a budget, measured at k at batch size 1."""
    tree = profile.dump()
    tree["run"] |= {"output_dir": str(stage_dir(profile, "data_curve")), "name": point_name(record)}
    tree["train"]["max_train_tokens"] = record.tokens
    tree["server"]["base_url"] = None  # the point's own drafter, served by its eval
    tree["eval"] |= {
        "methods": ["eagle3"],
        "num_speculative_tokens": [k],
        "concurrency": [1],
        "reference_drafters": [],
        "sampled": None,
        "lm_eval_tasks": [],
        "min_acceptance_length": 1.0,  # a small budget may draft badly: measured, not refused
    }
    tree["data_curve"] = None
    return Profile.model_validate(tree)


def point_name(record: TrainingData) -> str:
    return f"tokens-{record.tokens}"


def prepare_point(profile: Profile, point: Profile) -> Path:
    """The point run's folder: links to this run's shared stages, and its profile file."""
    run_dir = point.run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED_STAGES:
        link = run_dir / stage
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(stage_dir(profile, stage), run_dir))
    config = run_dir / "profile.yaml"
    text = yaml.safe_dump(point.dump(), sort_keys=False).encode()
    if config.exists() and config.read_bytes() != text:  # another recipe: start the point over
        start_over(point)
    atomic_write_bytes(config, text)
    return config


def start_over(point: Profile) -> None:
    """Drop the point's train and eval: speculators would otherwise resume from its last
    checkpoint and call the old drafter done."""
    for stage in ("train", "eval"):
        shutil.rmtree(stage_dir(point, stage), ignore_errors=True)


def fresh(run: Profile, stage: str) -> bool:
    """``stage`` of ``run`` is finished and fresh over its inputs, up the pipeline."""
    try:
        stage_manifest(run, stage)
    except PipelineError:
        return False
    return True


def run_point(point: Profile, config: Path) -> None:
    """The point's train, then its eval, each as its own stage process."""
    folder = point.run.run_dir
    for module in ("pipeline.train", "eval"):
        name = module.rsplit(".", 1)[-1]
        run_logged(
            [sys.executable, "-m", module, "--config", str(config)],
            folder / f"{name}.log",
            DataCurveError,
            f"{name} of the data curve's point {point.run.name}",
            env={**os.environ, "PROGRESS": "0"},
        )


def arm_at(results: dict[str, Any], method: str, k: int) -> dict[str, Any] | None:
    """Our ``method`` at k and batch size 1 in an eval's results (None when it was not measured;
    reference drafters are not ours):
    acceptance, speedup over the verifier alone, and whether its outputs were the baseline's."""
    for arm in results["runs"]:
        if arm["method"] == method and arm["k"] == k and arm.get("reference") is None:
            level = next(lv for lv in arm["levels"] if lv["concurrency"] == 1)
            acceptance = level["acceptance"]
            return {
                "mean_acceptance_length": acceptance["mean_acceptance_length"],
                "acceptance_rate": acceptance["acceptance_rate"],
                "per_position_acceptance": acceptance["per_position_acceptance"],
                "speedup": level.get("speedup"),
                "output_tokens_per_s": level["output_tokens_per_s"],
                "prompts": level["prompts"],
                "greedy_outputs_identical": not level.get("mismatched_prompt_ids"),
            }
    return None


def eval_results(run: Profile, evaluated: Manifest[EvalOutputs]) -> dict[str, Any]:
    """The results of ``run``'s eval, whose manifest was read (and checked) as ``evaluated``."""
    return json.loads((stage_dir(run, "eval") / evaluated.outputs.results).read_text())


def measured(
    name: str, record: TrainingData, k: int, train: TrainOutputs, results: dict[str, Any]
) -> dict[str, Any]:
    """One point of the curve from a run's train outputs and its eval's EAGLE-3 arm at k."""
    arm = arm_at(results, "eagle3", k)
    if arm is None:
        raise DataCurveError(f"the eval of {name} has no EAGLE-3 arm at k={k} and batch size 1")
    return {
        "run": name,
        "train_tokens": record.tokens,
        "training_data": record.record(),
        "val_metrics": train.val_metrics,
        "global_steps": train.global_steps,
        "draft_vocab_size": train.draft_vocab_size,
        "num_speculative_tokens": k,
        **arm,
    }


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
    fig.tight_layout()
    tmp = path.with_name(path.name + ".partial")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    curve = profile.data_curve
    if curve is None:  # hero-run asks every profile; this one wants no curve
        log.info("data curve: the profile has no data_curve section, nothing to measure")
        return {"stage": "data_curve", "counts": {"skipped": "no data_curve section"}}
    read_input(profile, "data_curve", "verifier")
    # The whole data's point is this run's drafter when it was trained on this recipe.
    own = read_input(profile, "data_curve", "train")
    own_recipe = (
        own.config["train"] == profile.dump()["train"] and not profile.train.max_train_tokens
    )
    extract = read_input(profile, "data_curve", "extract")
    evaluated = read_input(profile, "data_curve", "eval")
    k = curve.num_speculative_tokens or evaluated.outputs.summary["num_speculative_tokens"]
    results = eval_results(profile, evaluated)
    prepared = stage_dir(profile, "extract") / extract.outputs.prepared
    todo, unreached = budgets(curve, *split_lengths(prepared), profile.train.train_data_ratio)
    folder = stage_dir(profile, "data_curve")
    folder.mkdir(parents=True, exist_ok=True)
    points = []
    bar = progress(total=len(todo), desc="data curve", unit="point")
    with bar:
        for record in todo:
            if record.whole and own_recipe and arm_at(results, "eagle3", k):
                # This run's own drafter: the same recipe on all of the data, measured by eval.
                points.append(measured(".", record, k, own.outputs, results))
            else:
                point = point_profile(profile, record, k)
                config = prepare_point(profile, point)
                if not fresh(point, "eval"):
                    log.info("data curve: training and measuring %s", point.run.name)
                    if manifest_path(point, "train").exists() and not fresh(point, "train"):
                        start_over(point)  # trained on data since rerun
                    run_point(point, config)
                trained = stage_manifest(point, "train").outputs
                measured_at = eval_results(point, stage_manifest(point, "eval"))
                points.append(measured(point.run.name, record, k, trained, measured_at))
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
