"""Stage `eval`: acceptance, speedup and losslessness of the drafter against its verifier, in vLLM.

Run as: python -m eval --config configs/tiny.yaml   (make eval)
   or:  make eval BASE_URL=http://host:8000   (a deployment someone already runs)

Reads the `verifier`, `generate` (to prove the prompts are held out) and `train` stages and the
evaluation prompts (``eval/prompts.py``). Serves the verifier once per arm on the same
flags: without speculation (the paired baseline), then vLLM's ngram drafter, our EAGLE-3
drafter and each reference drafter (``eval.reference_drafters``: published drafters, converted
by ``eval/references.py`` where vLLM needs it) at each k in ``eval.num_speculative_tokens``.
Without ``eagle3`` in ``eval.methods`` it measures the reference drafters alone and needs no
`train` stage: the "test the published drafter first" step. Each arm sends the same greedy
requests at each level of ``eval.concurrency``, ``eval.repeats`` times on its server.
Acceptance comes from ``/metrics`` counter deltas (prometheus-client's parser), around each
pass and, at concurrency 1, around each request (so per prompt and per category), in vLLM's
conventions: acceptance rate (with k), mean acceptance length 1 + accepted / drafts,
per-position acceptance; then output tokens/s, time per output token and speedup against the
baseline at the same concurrency, each with a 95% bootstrap interval over prompts
(``eval.intervals``). Each arm is measured once more at the verifier's deployment sampling
(``eval.sampled``), its replies tested against the baseline's as distributions
(``eval.sampled_lossless``).

Writes ``<run>/eval/results.json`` (every arm and level with its intervals, per category with
too-small categories marked, losslessness, the headline: the EAGLE-3 k with the best
batch-size-1 speedup when its lead is beyond the noise, else the smaller k, beside ngram and
each reference drafter at that k, and the k to use at each measured concurrency; the prompts
skipped as too long for the context), ``results.md``, four PNG plots, ``outputs.json`` (every
response, with its token ids), ``samples.json`` (each prompt's measurements pooled over
repeats: what the intervals resample), ``lm-eval/<arm>.json`` (lm-eval's scores and each
document's response, with and without the drafter) and ``manifest.json``.

Invariants (each a refusal or an error naming what to check, never a silent number):
- a prompt longer than ``server.max_model_len - eval.max_tokens`` tokens (the verifier's
  tokenizer and chat template) is skipped before any server starts and named, with its
  category and token count, in ``results.json`` and ``results.md``;
- the drafter's recorded verifier, capture-layer ids and chat-template hash are those served;
- an EAGLE-3 arm with no draft step, or 0 accepted tokens (acceptance length exactly 1.0);
- greedy outputs with each drafter are compared token by token with the baseline's, and
  lm-eval's scores with and without the drafter must match (``eval/lossless_lm_eval.py``);
  differences are reported by prompt or document id; sampled replies are compared as
  distributions, by a stated permutation test and its p-values.

This module is the stage's story (:func:`run`); the steps live in ``eval.measure`` (servers and
requests), ``eval.guards`` (the invariants above), ``eval.intervals`` (the bootstrap),
``eval.summary`` (speedups, headline) and
``eval.report`` (the files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eval.arms import Arm, planned_arms
from eval.guards import (
    check_consistency,
    check_drafter_matches,
    compare_with_baseline,
    skip_too_long,
    train_serve_consistency,
)
from eval.intervals import Bootstrap, add_intervals
from eval.measure import measure_arms, take_outputs
from eval.prompts import check_held_out, eval_data_revision, load_eval_prompts
from eval.references import prepare_references
from eval.report import write_results
from eval.sampled_lossless import compare_sampled_arms
from eval.summary import build_results, headline
from pipeline.core.config import Profile
from pipeline.core.contracts import EvalOutputs
from pipeline.core.drafter import drafter_digest
from pipeline.core.manifest import now, read_input, stage_dir, write_manifest


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "eval")
    folder.mkdir(parents=True, exist_ok=True)
    # Without our drafter among the methods (reference drafters alone), nothing is trained yet.
    train = read_input(profile, "eval", "train").outputs if ours(profile) else None
    generate = read_input(profile, "eval", "generate").outputs
    prompts = load_eval_prompts(profile)
    check_held_out(prompts, stage_dir(profile, "generate") / generate.responses)
    verifier_outputs = read_input(profile, "eval", "verifier").outputs
    verifier = verifier_outputs.model
    deployed = profile.server.base_url is not None
    references: dict[str, Any] = {}
    drafters: dict[str | None, str] = {None: train.drafter} if train else {}
    if deployed:
        arms = [Arm("served")]  # measured as it runs: no paired baseline, nothing started
    else:
        if train:
            check_drafter_matches(verifier_outputs, train, profile.server.extra_args)
        paths, references = prepare_references(profile, verifier_outputs, folder)
        drafters |= paths
        arms = planned_arms(profile)
    # Before any server starts: a prompt vLLM would refuse for its length is skipped and named.
    asked = len(prompts)
    prompts, skipped = skip_too_long(prompts, verifier, profile)
    runs, lm_scores = measure_arms(
        profile, arms, prompts, verifier=verifier, drafters=drafters, folder=folder,
        deployed=deployed,
    )  # fmt: skip
    compare_with_baseline(runs)
    if profile.eval.sampled is not None:
        compare_sampled_arms(runs, profile.eval.sampled, profile.run.seed)
    bootstrap = Bootstrap(profile.eval.bootstrap_resamples, profile.run.seed)
    add_intervals(runs, bootstrap, profile.eval.min_category_prompts)
    for measured in runs:  # results are published: a reference is named by its source
        if measured["reference"]:
            source = references[measured["reference"]]["source"]
            measured["spec"] = {**measured["spec"], "model": source}
    summary = headline(runs, bootstrap)
    outputs, samples = take_outputs(runs)
    results = build_results(
        profile,
        runs,
        summary,
        prompts=prompts,
        skipped=skipped,
        lm_scores=lm_scores,
        drafter=train.drafter if train else None,
        verifier=verifier,
        references=references,
    )
    consistency = []
    if train and not deployed and summary["series"] == "eagle3":
        served = summary["per_position_acceptance"]
        consistency = train_serve_consistency(train.val_metrics, served)
        results["train_serve"] = {
            "min_ratio": profile.eval.min_served_over_validation,
            "positions": consistency,
        }
    write_results(profile, folder, results, outputs, samples, deployed=deployed)
    # After the results are on disk: a refusal leaves every figure to look at.
    where = f"eagle3 k={summary['num_speculative_tokens']} at batch size 1"
    check_consistency(consistency, profile.eval.min_served_over_validation, where)
    return write_manifest(
        profile,
        "eval",
        started_at=started,
        counts={
            "input": asked,
            "succeeded": len(prompts),
            "skipped": skipped["count"],
            "failed": 0,
            "skip_reasons": {"prompt_too_long": skipped["count"]} if skipped["count"] else {},
        },
        outputs=EvalOutputs(
            results="results.json",
            summary=summary,
            # What was measured; None for a deployment or reference drafters alone, which card
            # and publish refuse.
            drafter_sha256=drafter_digest(Path(train.drafter)) if train and not deployed else None,
        ),
        data_revision=eval_data_revision(profile),
    )


def ours(profile: Profile) -> bool:
    """Whether eval measures our trained drafter (and so reads the train stage)."""
    return "eagle3" in profile.eval.methods or profile.server.base_url is not None


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("eval", run, argv)
