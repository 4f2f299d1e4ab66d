"""Kimi-K2.5 in miniature: a DeepSeek-V3 text model (MLA attention, MoE MLP) in Kimi-K2.5's
multimodal wrapper config, trained briefly on a corpus and saved as Kimi-K2.5 is on the Hub.

The folder declares ``KimiK25ForConditionalGeneration`` with the text model's config nested as
``text_config`` (``model_type: kimi_k2``, ``DeepseekV3ForCausalLM``), its weights under
``language_model.``, a ``vision_config`` but no vision weights (text-only serving uses
``--language-model-only``), ``media_placeholder_token_id`` (vLLM's EAGLE drafter loader reads it
for Kimi-K2.5 targets) and a ``preprocessor_config.json`` with ``media_proc_cfg`` (vLLM's
Kimi-K2.5 processor reads it even when serving text only).

Kimi-K2.5's own values are kept where a kernel or a code path depends on them: MLA with
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the only shape vLLM's CPU MLA kernel takes), a
query LoRA, sigmoid ``noaux_tc`` routing with a shared expert and a dense first layer. Only the
sizes shrink.

Invariants: the same profile, seed and corpus give the same weights on CPUs of one instruction
set (torch's AVX2 and AVX-512 kernels sum floats differently, so the weights differ between
them); the folder is what vLLM reads and, through its text view
(``pipeline.training.text_view``), what transformers reads, so vLLM can be checked against
transformers on it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile
from pipeline.core.progress import progress
from pipeline.verifier.chat_format import MEDIA_PLACEHOLDER, TURN_END

ARCHITECTURE = "KimiK25ForConditionalGeneration"
TEXT_ARCHITECTURE = "DeepseekV3ForCausalLM"
WEIGHT_PREFIX = "language_model."
WEIGHTS_FILE = "model.safetensors"
# Kimi-K2.5's MLA shape, which vLLM's CPU MLA decode kernel requires as well.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
# Kimi-K2.5's vision tower and media processor, in miniature: read, never run, when serving text.
VISION_CONFIG = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "merge_kernel_size": [2, 2],
    "mm_hidden_size": 64,
    "text_hidden_size": None,  # set to the text model's hidden size
}
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "temporal_merge_kernel_size": 4,
    "sample_fps": 2.0,
    "timestamp_mode": "hh:mm:ss.fff",
}


def text_config(profile: Profile, tokenizer) -> dict[str, Any]:
    """The DeepSeek-V3 text model's config, as Kimi-K2.5 nests it in ``text_config``."""
    spec = profile.verifier.build
    assert spec is not None
    return {
        "architectures": [TEXT_ARCHITECTURE],
        "model_type": "kimi_k2",
        "vocab_size": len(tokenizer),
        "hidden_size": profile.verifier.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": profile.verifier.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "n_routed_experts": spec.n_routed_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": spec.qk_nope_head_dim,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }


def wrapper_config(text: dict[str, Any], tokenizer) -> dict[str, Any]:
    """Kimi-K2.5's top-level config around ``text``."""
    media = tokenizer.convert_tokens_to_ids(MEDIA_PLACEHOLDER)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {**VISION_CONFIG, "text_hidden_size": text["hidden_size"]},
        "media_placeholder_token_id": media,
        "image_token_id": media,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _deepseek_config(text: dict[str, Any]):
    from transformers import DeepseekV3Config

    fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    fields.pop("torch_dtype")
    config = DeepseekV3Config(**fields)
    config.architectures = [TEXT_ARCHITECTURE]
    return config


def train_text_model(profile: Profile, tokenizer, texts: list[str]) -> tuple[Any, dict]:
    """The DeepSeek-V3 text model, trained on the chat-formatted ``texts`` from the run seed."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    spec = profile.verifier.build
    assert spec is not None
    seed = profile.run.seed
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(_deepseek_config(text_config(profile, tokenizer)))
    stream = torch.tensor([i for t in texts for i in tokenizer(t)["input_ids"]], dtype=torch.long)
    if len(stream) <= spec.seq_len + 1:
        raise ValueError(f"verifier.build.corpus has {len(stream)} tokens; need > seq_len")
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    warmup = max(1, spec.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / spec.train_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    model.train()
    losses = []
    bar = progress(range(spec.train_steps), desc="verifier: train tiny Kimi-K2.5", unit="step")
    for _ in bar:
        starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + spec.seq_len + 1] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return model, {
        "train_tokens": len(stream),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
    }


def save_kimi_folder(model, profile: Profile, tokenizer, out: Path) -> None:
    """Write ``model`` as a Kimi-K2.5 checkpoint folder (config, weights, tokenizer)."""
    import torch
    from safetensors.torch import save_file

    text = text_config(profile, tokenizer)
    state = model.state_dict()
    weights = {}
    for name, tensor in state.items():
        weights[WEIGHT_PREFIX + name] = tensor.detach().contiguous()
    for name in list(weights):
        # transformers keeps routed experts fused; Kimi-K2.5 (and vLLM) name them one by one
        if name.endswith("mlp.experts.gate_up_proj"):
            fused = weights.pop(name)
            base = name[: -len("gate_up_proj")]
            gate, up = fused.chunk(2, dim=1)
            for e in range(fused.shape[0]):
                weights[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                weights[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            fused = weights.pop(name)
            base = name[: -len("down_proj")]
            for e in range(fused.shape[0]):
                weights[f"{base}{e}.down_proj.weight"] = fused[e].contiguous()
    save_file({k: v.to(torch.float32) for k, v in weights.items()}, out / WEIGHTS_FILE)
    (out / "config.json").write_text(json.dumps(wrapper_config(text, tokenizer), indent=2) + "\n")
    end = tokenizer.convert_tokens_to_ids(TURN_END)
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        # Kimi-K2.5 stops at the end of the assistant turn, not at [EOS]
        "eos_token_id": end,
        "pad_token_id": tokenizer.pad_token_id,
        "temperature": 1.0,
        "top_p": 0.95,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n"
    )
    tokenizer.save_pretrained(out)
