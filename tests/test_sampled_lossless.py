"""The distribution test of losslessness at sampling temperature: its false-alarm rate and its
power, on replies drawn here from known distributions (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from eval.sampled_lossless import distribution_test
from pipeline.core.config import SampledEvalConfig

pytestmark = pytest.mark.unit

CONFIG = SampledEvalConfig(permutations=1000, alpha=0.01)
PROMPTS, REPLIES = 24, 4


def replies(rng: np.random.Generator, temperature: float = 1.0, stop: float = 0.03) -> dict:
    """Each prompt's replies: tokens from the prompt's own distribution over 50 tokens (sharper
    at a lower temperature), stopping with probability ``stop`` after each token."""
    out = {}
    for p in range(PROMPTS):
        logits = np.random.default_rng(1000 + p).normal(0, 2, 50)  # the prompt's, every arm
        probs = np.exp(logits / temperature)
        probs /= probs.sum()
        out[f"p{p}"] = []
        for _ in range(REPLIES):
            length = min(int(rng.geometric(stop)), 96)
            tokens = [int(t) for t in rng.choice(50, size=length, p=probs)]
            out[f"p{p}"].append({"token_ids": tokens, "text": "", "completion_tokens": length})
    return out


def test_replies_from_one_distribution_are_indistinguishable_at_the_stated_rate():
    alarms = 0
    for trial in range(20):
        base, mine = (
            replies(np.random.default_rng(trial)),
            replies(np.random.default_rng(99 + trial)),
        )
        result = distribution_test(base, mine, CONFIG, seed=trial)
        assert result["replies"] == {"baseline": 96, "drafter": 96}
        assert 0 < result["length_p_value"] <= 1 and 0 < result["token_frequency_p_value"] <= 1
        alarms += not result["indistinguishable"]
    assert alarms <= 1  # alpha 0.01: about 0.2 expected in 20 trials


def test_a_changed_temperature_is_caught():
    base = replies(np.random.default_rng(1))
    sharper = replies(np.random.default_rng(2), temperature=0.85)
    result = distribution_test(base, sharper, CONFIG, seed=0)
    assert not result["indistinguishable"]
    assert result["token_frequency_p_value"] < CONFIG.alpha / 2


def test_replies_cut_shorter_are_caught():
    base = replies(np.random.default_rng(1))
    shorter = replies(np.random.default_rng(2), stop=0.06)
    result = distribution_test(base, shorter, CONFIG, seed=0)
    assert not result["indistinguishable"] and result["length_p_value"] < CONFIG.alpha / 2
    assert result["mean_reply_tokens"]["drafter"] < result["mean_reply_tokens"]["baseline"]


def test_prompts_that_differ_from_each_other_make_no_difference_appear():
    """Within-prompt permutation: the same replies, each arm's own, read in another prompt
    order, are still one distribution."""
    base = replies(np.random.default_rng(1))
    mine = replies(np.random.default_rng(2))
    result = distribution_test(base, mine, CONFIG, seed=0)
    again = distribution_test(base, dict(reversed(list(mine.items()))), CONFIG, seed=0)
    assert result == again
