"""The checks that make eval's numbers trustworthy: each a refusal naming what to check.

- a prompt too long for the context is skipped before any server starts and named
  (:func:`skip_too_long`), never cut short or refused mid-measurement;
- the drafter's recorded verifier, capture-layer ids and chat-template hash are those served,
  a ``--chat-template`` in ``server.extra_args`` included (:func:`check_drafter_matches`);
- an EAGLE-3 (or served) arm that drafted nothing, or accepted about nothing, is an error, not a
  result (:func:`check_acceptance`);
- every arm's greedy outputs are compared token by token with the baseline's at the same
  concurrency, and the differing prompt ids recorded (:func:`compare_with_baseline`; with
  ``eval.repeats``, the first repeat's, each later one compared with the first in
  ``eval.measure``);
- the headline EAGLE-3 arm's acceptance per draft position is held against the drafter's own
  validation accuracy there, and one far below it is an error naming the likely train/serve
  mismatches (:func:`train_serve_consistency`, :func:`check_consistency`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eval.arms import Arm
from eval.prompts import EvalPrompt, fit_to_context, prompt_token_counts
from eval.summary import ratio
from pipeline.core.config import Profile
from pipeline.core.contracts import TrainOutputs, VerifierOutputs
from pipeline.core.drafter import aux_layer_ids, drafter_config
from pipeline.core.errors import PipelineError
from pipeline.serving.vllm_api import served_chat_template_sha256

log = logging.getLogger(__name__)


class EvalError(PipelineError):
    """An evaluation whose numbers cannot be trusted; the message says what to check."""


def skip_too_long(
    prompts: list[EvalPrompt], verifier: str, profile: Profile
) -> tuple[list[EvalPrompt], dict[str, Any]]:
    """The prompts that fit ``server.max_model_len - eval.max_tokens`` tokens (the verifier's
    tokenizer and chat template), and the record of those skipped, each named in a warning."""
    prompts, skipped = fit_to_context(
        prompts, prompt_token_counts(prompts, verifier, profile), profile
    )
    for p in skipped["prompts"]:
        log.warning(
            "eval: skipping prompt %s (%s): %d tokens, over server.max_model_len - eval.max_tokens"
            " = %d",
            p["id"],
            p["category"],
            p["prompt_tokens"],
            skipped["max_prompt_tokens"],
        )
    return prompts, skipped


def check_drafter_matches(
    verifier: VerifierOutputs, train_outputs: TrainOutputs, server_args: list[str]
) -> None:
    """Refuse a drafter trained against another verifier, layers or chat template than the
    served ``verifier`` (the `verifier` stage's outputs) with ``server_args`` (a
    ``--chat-template`` among them replaces the verifier's own)."""
    trained_on = train_outputs.verifier
    served = {
        "model": verifier.model,
        "capture_layer_ids": verifier.capture_layer_ids,
        "chat_template_sha256": served_chat_template_sha256(
            server_args, verifier.chat_template_sha256
        ),
    }
    for key, want in served.items():
        if trained_on.get(key) != want:
            also = ""
            if key == "chat_template_sha256":
                also = " (a --chat-template in server.extra_args included)"
            raise EvalError(
                f"the drafter was trained with {key}={trained_on.get(key)!r} but the served "
                f"verifier has {key}={want!r}{also}; retrain (`make train`) or serve the right "
                "verifier"
            )
    config_path = Path(train_outputs.drafter) / "config.json"
    config = drafter_config(Path(train_outputs.drafter))
    layers = aux_layer_ids(config)
    if layers != trained_on["capture_layer_ids"]:
        raise EvalError(
            f"{config_path} reads capture layers {layers} but its hidden states were captured at "
            f"{trained_on['capture_layer_ids']}; vLLM would feed the drafter the wrong layers "
            "(acceptance near 1.0). Retrain with `make train`, or fix "
            "eagle_aux_hidden_state_layer_ids"
        )
    named = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    if named is not None and Path(named).name != Path(verifier.model).name:
        raise EvalError(
            f"{config_path} names verifier {named!r} but {verifier.model!r} is served; "
            "evaluate the drafter against the verifier it was trained for"
        )


def check_acceptance(arm: Arm, level: dict[str, Any], min_length: float) -> None:
    """An EAGLE-3 (or served) arm that drafted nothing, or (ours) whose acceptance length is
    what an untrained or miswired drafter gives (about 1.0), is an error, not a result; a
    reference drafter's low acceptance is a result about it."""
    if arm.method not in ("eagle3", "served"):
        return
    where = f"{arm.label} at concurrency {level['concurrency']}"
    acc = level["acceptance"]
    if acc is None or not acc["drafts"]:
        raise EvalError(
            f"{where}: the drafter ran no draft step (vLLM's spec-decode counters did not move); "
            "check that --speculative-config reached the server (method 'eagle3') and its log"
        )
    length = acc["mean_acceptance_length"]
    if arm.reference:  # a published drafter is measured as it is, near-zero acceptance included
        return
    if acc["accepted_tokens"] == 0 or length < min_length:
        raise EvalError(
            f"{where}: {acc['accepted_tokens']} accepted tokens in {acc['drafts']} drafts, mean "
            f"acceptance length {length:.4f}, below eval.min_acceptance_length={min_length}: "
            "what an untrained or miswired drafter gives. Check the drafter's capture-layer ids, "
            "its verifier and draft vocabulary, and that it trained"
        )


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same reply, token by token (text where a server gave no ids), turn by turn."""
    turns_a, turns_b = a.get("turns", [a]), b.get("turns", [b])
    if len(turns_a) != len(turns_b):
        return False
    for x, y in zip(turns_a, turns_b, strict=True):
        if x["token_ids"] is not None and y["token_ids"] is not None:
            if x["token_ids"] != y["token_ids"]:
                return False
        elif x["text"] != y["text"]:
            return False
    return True


def compare_with_baseline(runs: list[dict[str, Any]]) -> None:
    """Speedup and greedy-output identity of every arm against the baseline, level by level;
    the speedup of its sampled level, whose replies are compared as distributions
    (:mod:`eval.sampled_lossless`)."""
    baseline = next((r for r in runs if r["method"] == "baseline"), None)
    if baseline is None:
        return
    base_levels = {lv["concurrency"]: lv for lv in baseline["levels"]}
    for run in runs:
        if run is baseline:
            continue
        for level in run["levels"]:
            base = base_levels[level["concurrency"]]
            add_speedups(level, base)
            level["mismatched_prompt_ids"] = sorted(
                pid
                for pid, out in base["outputs"].items()
                if not same_output(out, level["outputs"][pid])
            )
        if "sampled" in run and "sampled" in baseline:  # replies differ by design: speed only
            add_speedups(run["sampled"], baseline["sampled"])


def add_speedups(level: dict[str, Any], base: dict[str, Any]) -> None:
    """A level's speedup over the baseline's, each category's over its category and each
    repeat's over the baseline's same repeat."""
    level["speedup"] = ratio(base["time_per_output_token_s"], level)
    for cat, figs in level.get("per_category", {}).items():
        figs["speedup"] = ratio(base["per_category"][cat]["time_per_output_token_s"], figs)
    for mine, base_repeat in zip(
        level.get("per_repeat", []), base.get("per_repeat", []), strict=True
    ):
        mine["speedup"] = ratio(base_repeat["time_per_output_token_s"], mine)


def train_serve_consistency(
    val_metrics: dict[str, float] | None, served: list[float]
) -> list[dict[str, Any]]:
    """Per draft position: speculators' validation accuracy, vLLM's served acceptance, and
    served / validation. speculators' ``full_acc_i`` feeds the drafter its own earlier drafts
    and counts position i only when every earlier one was right, as vLLM's per-position
    acceptance does, so the two measure the same thing on different prompts."""
    rows = []
    for i, accepted in enumerate(served):
        validation = (val_metrics or {}).get(f"full_acc_{i}_epoch")
        if validation is None:
            break  # trained for fewer steps ahead than served
        ratio_ = accepted / validation if validation > 0 else None
        rows.append(
            {"position": i + 1, "validation": validation, "served": accepted, "ratio": ratio_}
        )
    return rows


# A position whose validation accuracy is below this is not judged: the ratio of two small rates
# is noise (a drafter trained on little data drafts far ahead almost never right), and a miswired
# drafter shows where accuracy is highest, at the first positions.
JUDGED_FROM_VALIDATION = 0.1


def check_consistency(rows: list[dict[str, Any]], min_ratio: float, where: str) -> None:
    """A served acceptance far below validation is an error naming what usually differs."""
    low = [
        r
        for r in rows
        if r["ratio"] is not None
        and r["validation"] >= JUDGED_FROM_VALIDATION
        and r["ratio"] < min_ratio
    ]
    if not low:
        return
    figures = ", ".join(
        f"position {r['position']}: {r['served']:.3f} served, {r['validation']:.3f} in "
        f"validation ({r['ratio']:.2f}x)"
        for r in low
    )
    raise EvalError(
        f"{where}: served acceptance is far below the drafter's validation accuracy ({figures}; "
        f"eval.min_served_over_validation={min_ratio}). Training and serving disagree: check "
        "the chat template the server applies (a --chat-template in server.extra_args, the "
        "tokenizer's own), server.max_model_len against train.total_seq_len, the dtype, and "
        "the capture-layer ids; results.md has every figure"
    )
