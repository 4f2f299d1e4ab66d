"""Stage `tune`: which training recipe, answered by measurement instead of by feel.

Run as: python -m pipeline.tune --config configs/smollm2-135m.yaml   (make tune)

Reads `verifier`, `extract` (the prepared data every variant trains on), `train` (this run's
drafter, the recipe every variant departs from) and `eval` (its measurement at the k of the
headline, and vLLM's ngram drafter there). For each value of ``tune.draft_vocab_size``,
``tune.learning_rate`` and ``tune.epochs`` it trains a drafter with that one field of
``train`` changed, on all of extract's training split, and measures it in vLLM at k and batch
size 1 against the verifier alone, on eval's prompts, by running the `train` and `eval` stages
themselves on a point run of its own, ``tune/<field>-<value>/``
(:mod:`pipeline.training.point_runs`). Writes ``tune.json`` (every variant beside this run's
drafter: validation accuracy, served acceptance, speedup, and their differences),
``tune.png`` and ``manifest.json``; the card shows what moved the number.

Invariants:
- one field changes per variant, everything else (data, validation rows, seed, k, prompts) is
  the run's own, so a difference is that field's;
- the base is this run's own drafter and eval, never trained again, and must be the profile's
  recipe on all of the data, measured by eval at k and batch size 1;
- variants are kept, resumed and started over as point runs are;
- a profile without a ``tune`` section has nothing to measure and writes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json, save_figure_atomically
from pipeline.core.config import Profile
from pipeline.core.contracts import TuneOutputs
from pipeline.core.errors import PipelineError
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

log = logging.getLogger(__name__)
PLOT = "tune.png"
SUMMARY_KEYS = ("run", "mean_acceptance_length", "speedup", "acceptance_rate", "val_accuracy")


class TuneError(PipelineError):
    """The sweep has no base to compare its variants with."""


def variant_name(field: str, value: float) -> str:
    return f"{field}-{value}"


def val_accuracy(point: dict[str, Any]) -> float | None:
    """Speculators' validation accuracy at the first draft position, where it recorded one."""
    value = (point.get("val_metrics") or {}).get("full_acc_0_epoch")
    return None if value is None else float(value)


def compared(point: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A variant with its differences from the base: what moving its field moved."""
    delta = {}
    for key in ("mean_acceptance_length", "speedup", "val_accuracy"):
        if point.get(key) is not None and base.get(key) is not None:
            delta[key] = round(point[key] - base[key], 4)
    return {**point, "delta": delta}


def plot(base: dict[str, Any], variants: list[dict[str, Any]], k: int, path: Path) -> None:
    """Mean acceptance length and speedup of each variant, this run's recipe as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{v['field']}={v['value']}" for v in variants]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.5 * len(variants) + 2), dpi=120)
    for ax, key, label in zip(
        axes,
        ("mean_acceptance_length", "speedup"),
        ("mean acceptance length", "speedup (x)"),
        strict=True,
    ):
        measured_at = [(name, v[key]) for name, v in zip(labels, variants, strict=True)
                       if v[key] is not None]  # fmt: skip
        # Dots, not bars from zero: the differences are hundredths of an acceptance length.
        ax.plot([value for _, value in measured_at], [name for name, _ in measured_at], "o",
                color="#3b6ea8", markersize=8)  # fmt: skip
        ax.margins(x=0.4, y=0.25)
        if base.get(key) is not None:
            ax.axvline(base[key], ls="--", color="#5a5a5a", label="this run's recipe")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"{label}, k={k}, batch size 1")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("Which recipe: one training field changed at a time", fontsize=10)
    save_figure_atomically(fig, path)


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    tune = profile.tune
    if tune is None:  # hero-run asks every profile; this one wants no sweep
        log.info("tune: the profile has no tune section, nothing to measure")
        return {"stage": "tune", "counts": {"skipped": "no tune section"}}
    if profile.server.base_url:
        raise TuneError(
            f"tune trains and serves its own variants, not the deployment at "
            f"{profile.server.base_url}: run `make tune` without BASE_URL or server.base_url"
        )
    this_run = read_sweep_base(profile, "tune", tune.num_speculative_tokens)
    own, k, results = this_run.train, this_run.k, this_run.results
    if not own_recipe(profile, own):
        raise TuneError(
            "this run's drafter, the base every variant is compared with, was trained with "
            "another train section than the profile's: rerun `make train` and `make eval`"
        )
    if arm_at(results, "eagle3", k) is None:
        raise TuneError(
            f"eval measured no EAGLE-3 arm of this run's drafter at k={k} and batch size 1: add "
            f"{k} to eval.num_speculative_tokens (eagle3 in eval.methods) and rerun `make eval`, "
            f"or set tune.num_speculative_tokens to a k eval measured"
        )
    base = measured(".", k, own.outputs, results)
    base["val_accuracy"] = val_accuracy(base)
    variants = []
    todo = tune.variants()
    with progress(total=len(todo), desc="tune", unit="variant") as bar:
        for field, value in todo:
            point = point_profile(profile, "tune", variant_name(field, value), {field: value}, k)
            config = prepare_point(profile, point)
            log.info("tune: %s", point.run.name)
            measure_point(point, config, f"the recipe variant {point.run.name}")
            record = measured(point.run.name, k, *measured_point(point))
            record |= {"field": field, "value": value, "val_accuracy": val_accuracy(record)}
            variants.append(compared(record, base))
            bar.update(1)
    folder = stage_dir(profile, "tune")
    folder.mkdir(parents=True, exist_ok=True)
    ngram = arm_at(results, "ngram", k)
    plot(base, variants, k, folder / PLOT)
    recipe = {field: getattr(profile.train, field) for field, _ in todo}
    atomic_write_json(
        folder / "tune.json",
        {"k": k, "recipe": recipe, "base": base, "variants": variants, "ngram": ngram},
    )
    return write_manifest(
        profile,
        "tune",
        started_at=started,
        counts=all_succeeded(len(variants)),
        outputs=TuneOutputs(
            results="tune.json",
            plot=PLOT,
            k=k,
            recipe=recipe,
            base={key: base[key] for key in SUMMARY_KEYS},
            variants=[
                {
                    "field": v["field"],
                    "value": v["value"],
                    **{key: v[key] for key in SUMMARY_KEYS},
                    "delta": v["delta"],
                }
                for v in variants
            ],
            ngram=ngram,
        ),
        data_revision=this_run.extract.data_revision,
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("tune", run, argv)


if __name__ == "__main__":
    main()
