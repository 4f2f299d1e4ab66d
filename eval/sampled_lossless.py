"""Losslessness at sampling temperature: a drafter's replies against the baseline's, as
distributions.

Under sampling a speculative server cannot be checked token by token: vLLM's rejection sampling
keeps the verifier's output distribution exactly, not the draw a given seed makes without
speculation. So each arm sends every prompt ``eval.sampled.replies_per_prompt`` times, each
request with its own seed (the same seeds in every arm); within an arm each reply is an
independent draw from the verifier's distribution for its prompt.

The stated test: a permutation test stratified by prompt (a prompt's replies are permuted between
the two arms, ``eval.sampled.permutations`` times, seeded by ``run.seed``) on two statistics of
the two arms' replies:
- reply length: the absolute difference of the mean reply length in tokens (in characters for a
  server that returns no token ids);
- token frequencies: the total variation distance between the two arms' token unigram
  distributions for the same prompt (the ``TOP_TOKENS`` most frequent tokens, the rest in one
  bin), averaged over prompts: a drafter that sharpens or flattens each prompt's distribution
  shows there even when the prompts' mixture looks the same.
Each p-value is (1 + permutations at least as extreme) / (1 + permutations). The arms are
distinguishable when either p-value is below ``eval.sampled.alpha / 2`` (Bonferroni).

Invariants: whole replies are permuted, so the test is exact whatever the dependence between the
tokens of one reply; permuting within prompts keeps each arm's prompt mix, so prompts that differ
from each other cannot make a difference appear. A baseline reply and a drafter reply of the same
seed may share a beginning (vLLM samples the first token before any draft, and ngram drafts
seldom): such pairs make the arms look closer than exchangeable replies would, so the test loses
power there, never its false-alarm rate.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from pipeline.core.config import SampledEvalConfig

TOP_TOKENS = 256


def reply_tokens(reply: dict[str, Any]) -> list[Any]:
    """A reply's token ids (its text's characters where the server gave no ids)."""
    return reply["token_ids"] if reply.get("token_ids") is not None else list(reply["text"])


def distribution_test(
    base: dict[str, list[dict[str, Any]]],
    mine: dict[str, list[dict[str, Any]]],
    config: SampledEvalConfig,
    seed: int,
) -> dict[str, Any]:
    """The stratified permutation test of ``mine``'s replies (by prompt id, each a list of
    replies) against ``base``'s, on the prompts both answered."""
    shared = sorted(set(base) & set(mine))
    if not shared:
        raise ValueError("no prompt has sampled replies from both arms to compare")
    rows: list[tuple[int, int, list[Any]]] = []  # (stratum, arm, tokens), grouped by stratum
    for stratum, pid in enumerate(shared):
        rows += [(stratum, 0, reply_tokens(r)) for r in base[pid]]
        rows += [(stratum, 1, reply_tokens(r)) for r in mine[pid]]
    strata = np.array([r[0] for r in rows])
    arm = np.array([r[1] for r in rows], dtype=float)
    lengths = np.array([len(r[2]) for r in rows], dtype=float)
    frequent = Counter(t for r in rows for t in r[2]).most_common(TOP_TOKENS)
    column = {token: i for i, (token, _) in enumerate(frequent)}
    counts = np.zeros((len(rows), len(column) + 1))
    for i, (_, _, tokens) in enumerate(rows):
        for token in tokens:
            counts[i, column.get(token, len(column))] += 1
    starts = np.flatnonzero(np.r_[True, strata[1:] != strata[:-1]])
    ends = np.r_[starts[1:], len(rows)]

    def statistics(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Both statistics for each row of ``labels`` (permutations x replies, 1 = mine)."""
        ones = labels.sum(axis=1)
        length = np.abs(labels @ lengths / ones - (1 - labels) @ lengths / (len(rows) - ones))
        tv = np.zeros(len(labels))
        for start, end in zip(starts, ends, strict=True):  # one prompt at a time: small memory
            mine_tokens = labels[:, start:end] @ counts[start:end]
            base_tokens = (1 - labels[:, start:end]) @ counts[start:end]
            with np.errstate(invalid="ignore", divide="ignore"):
                tv += np.nan_to_num(
                    0.5
                    * np.abs(
                        mine_tokens / mine_tokens.sum(axis=1, keepdims=True)
                        - base_tokens / base_tokens.sum(axis=1, keepdims=True)
                    ).sum(axis=1)
                )
        return length, tv / len(starts)

    observed_length, observed_tv = (s[0] for s in statistics(arm[None, :]))
    rng = np.random.default_rng(seed)
    # Random keys below 1 added to the stratum: sorting shuffles within each stratum only.
    order = np.argsort(strata[None, :] + rng.random((config.permutations, len(rows))), axis=1)
    permuted_length, permuted_tv = statistics(arm[order])
    tolerance = 1e-12  # ties count as extreme

    def p_value(permuted: np.ndarray, observed: float) -> float:
        return float((1 + (permuted >= observed - tolerance).sum()) / (1 + len(permuted)))

    p_length = p_value(permuted_length, observed_length)
    p_tokens = p_value(permuted_tv, observed_tv)
    return {
        "test": "permutation, stratified by prompt, Bonferroni over two statistics",
        "replies": {"baseline": int((arm == 0).sum()), "drafter": int((arm == 1).sum())},
        "permutations": config.permutations,
        "mean_reply_tokens": {
            "baseline": float(lengths[arm == 0].mean()),
            "drafter": float(lengths[arm == 1].mean()),
        },
        "length_p_value": p_length,
        "token_total_variation": float(observed_tv),
        "token_frequency_p_value": p_tokens,
        "alpha": config.alpha,
        "indistinguishable": min(p_length, p_tokens) >= config.alpha / 2,
    }


def compare_sampled_arms(runs: list[dict[str, Any]], config: SampledEvalConfig, seed: int) -> None:
    """The distribution test (``distribution``) on every drafting arm's sampled level against
    the baseline's."""
    baseline = next((r for r in runs if r["method"] == "baseline"), None)
    if baseline is None or "sampled" not in baseline:
        return
    for run in runs:
        if run is not baseline and "sampled" in run:
            run["sampled"]["distribution"] = distribution_test(
                baseline["sampled"]["replies"], run["sampled"]["replies"], config, seed
            )
