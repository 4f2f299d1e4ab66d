"""Point runs: a drafter trained and measured on a variation of this run, by the stages themselves.

The data curve (`data_curve`, a drafter per budget of training tokens) and the recipe sweep
(`tune`, a drafter per changed training field) measure the same kind of point: this run's
profile with some of ``train`` changed, trained by the `train` stage and measured by the `eval`
stage at one k and batch size 1 against the verifier alone, each as a subprocess, in a run
folder of its own, ``<run>/<stage>/<point>/``. That folder holds links to this run's verifier,
generate and extract folders (never a copy of hidden states), the point's profile file, and
the point's own train and eval folders.

Invariants:
- a point's profile is this run's with only ``train`` overrides, its eval restricted to
  EAGLE-3 at k and batch size 1 on the same prompts, and no point sweeps of its own;
- a finished point (its eval fresh over its train, both over this run's verifier and
  extract) is kept on a rerun; an unfinished one resumes where its train or eval stopped;
- a point whose profile changed, or whose training is stale (this run's verifier, generate or
  extract rerun since), is trained again from the start: speculators would otherwise resume
  from the old final checkpoint and call the old drafter done;
- each point's train and eval run under the server guard (``run_logged``), so they and their
  servers die with the stage that started them however it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile
from pipeline.core.contracts import EvalOutputs, ExtractOutputs, Manifest, TrainOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import manifest_path, read_input, stage_dir, stage_manifest
from pipeline.serving.logged_process import run_logged

# The stages a point run reads from this run, linked into its folder.
SHARED_STAGES = ("verifier", "generate", "extract")


class PointRunError(PipelineError):
    """A point could not be trained or measured."""


@dataclass(frozen=True)
class SweepBase:
    """What a sweep of points reads from this run: the extraction every point trains on, this
    run's drafter, the k every point is measured at, and eval's results (this run's arms and
    ngram's line)."""

    extract: Manifest[ExtractOutputs]
    train: Manifest[TrainOutputs]
    k: int
    results: dict[str, Any]


def read_sweep_base(profile: Profile, stage: str, k: int | None) -> SweepBase:
    """``stage``'s inputs from this run, each fresh; ``k`` None takes eval's headline k."""
    read_input(profile, stage, "verifier")
    extract = read_input(profile, stage, "extract")
    own = read_input(profile, stage, "train")
    evaluated = read_input(profile, stage, "eval")
    k = k or evaluated.outputs.summary["num_speculative_tokens"]
    return SweepBase(extract, own, k, eval_results(profile, evaluated))


def point_profile(
    profile: Profile, stage: str, name: str, train: dict[str, Any], k: int
) -> Profile:
    """The profile of the point ``name`` of ``stage``: this run's with ``train`` overrides,
    measured at k and batch size 1 on eval's prompts."""
    tree = profile.dump()
    tree["run"] |= {"output_dir": str(stage_dir(profile, stage)), "name": name}
    tree["train"] |= train
    tree["server"]["base_url"] = None  # the point's own drafter, served by its eval
    tree["eval"] |= {
        "methods": ["eagle3"],
        "num_speculative_tokens": [k],
        "concurrency": [1],
        "reference_drafters": [],
        "sampled": None,
        "lm_eval_tasks": [],
        "min_acceptance_length": 1.0,  # a weak point may draft badly: measured, not refused
    }
    tree["data_curve"] = tree["tune"] = None
    return Profile.model_validate(tree)


def prepare_point(profile: Profile, point: Profile) -> Path:
    """The point run's folder: links to this run's shared stages, and its profile file, which
    a changed recipe, k or prompts replaces after starting the point over."""
    run_dir = point.run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED_STAGES:
        link = run_dir / stage
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(stage_dir(profile, stage), run_dir))
    config = run_dir / "profile.yaml"
    if config.exists() and recorded_profile(config) != point:
        start_over(point)
    atomic_write_bytes(config, yaml.safe_dump(point.dump(), sort_keys=False).encode())
    return config


def recorded_profile(config: Path) -> Profile | None:
    """The profile a point was made with, as a profile (a field the schema gained since is no
    other recipe); None when it no longer reads as one."""
    try:
        return Profile.model_validate(yaml.safe_load(config.read_text()))
    except (ValidationError, yaml.YAMLError):
        return None


def start_over(point: Profile) -> None:
    """Drop the point's train and eval."""
    for stage in ("train", "eval"):
        shutil.rmtree(stage_dir(point, stage), ignore_errors=True)


def fresh(run: Profile, stage: str) -> bool:
    """``stage`` of ``run`` is finished and fresh over its inputs, up the pipeline."""
    try:
        stage_manifest(run, stage)
    except PipelineError:
        return False
    return True


def measure_point(point: Profile, config: Path, what: str) -> None:
    """Train the point and measure it, unless its eval is fresh; ``what`` names it in errors."""
    if fresh(point, "eval"):
        return
    if manifest_path(point, "train").exists() and not fresh(point, "train"):
        start_over(point)  # trained on data since rerun
    folder = point.run.run_dir
    for module in ("pipeline.train", "eval"):
        name = module.rsplit(".", 1)[-1]
        run_logged(
            [sys.executable, "-m", module, "--config", str(config)],
            folder / f"{name}.log",
            PointRunError,
            f"{name} of {what}",
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


def measured(name: str, k: int, train: TrainOutputs, results: dict[str, Any]) -> dict[str, Any]:
    """A point from a run's train outputs and its eval's EAGLE-3 arm at k and batch size 1."""
    arm = arm_at(results, "eagle3", k)
    if arm is None:
        raise PointRunError(f"the eval of {name} has no EAGLE-3 arm at k={k} and batch size 1")
    return {
        "run": name,
        "training_data": train.training_data,
        "val_metrics": train.val_metrics,
        "global_steps": train.global_steps,
        "draft_vocab_size": train.draft_vocab_size,
        "num_speculative_tokens": k,
        **arm,
    }


def measured_point(point: Profile) -> tuple[TrainOutputs, dict[str, Any]]:
    """A finished point's train outputs and eval results, read through their manifests."""
    trained = stage_manifest(point, "train").outputs
    return trained, eval_results(point, stage_manifest(point, "eval"))


def own_recipe(profile: Profile, trained: Manifest[TrainOutputs]) -> bool:
    """This run's drafter was trained on the profile's recipe, on all of the data."""
    return trained.config["train"] == profile.dump()["train"] and not (
        profile.train.max_train_tokens
    )
