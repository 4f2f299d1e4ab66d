"""Stage `verifier`: resolve the verifier, or build the tiny one the project makes itself.

Run as: python -m pipeline.verifier --config configs/tiny.yaml

With ``verifier.build`` set, this trains a byte-level BPE tokenizer and a small Llama on the
text of a shipped corpus, from the run seed, with no download, and saves an ordinary Hugging
Face model folder (config, safetensors weights, tokenizer with a chat template) in
``<run>/verifier/model``. The short training makes greedy continuations follow the corpus
instead of a constant or a short loop, which acceptance rates need to mean anything.

With ``verifier.model`` set, nothing is built: the manifest records the model id/path and
revision, and the dimensions and capture layers are checked against its config when it is a
local folder.

Invariants: the same profile and seed give the same tokenizer and the same weights; the
manifest records the chat template's sha256, which later stages compare against.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile, TinyVerifierBuild
from pipeline.core.contracts import VerifierOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    StageInputError,
    all_succeeded,
    now,
    stage_dir,
    stage_manifest,
    write_manifest,
)
from pipeline.core.model_names import looks_like_path, verifier_path
from pipeline.core.progress import progress
from pipeline.core.prompts import data_revision, load_prompts

log = logging.getLogger(__name__)
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# <think>/</think> exist so that vLLM's reasoning parsers (which look them up) can serve this model.
THINK_TOKENS = ["<think>", "</think>"]
SPECIAL_TOKENS = ["<|pad|>", "<|begin|>", "<|end|>", *ROLE_TOKENS, *THINK_TOKENS]
# Bump when the tokenizer, chat template or training code changes: a build is reused only when
# its recipe version, profile, seed and corpus all match.
RECIPE_VERSION = 2

# The assistant span is wrapped in {% generation %} so that transformers (and speculators'
# preprocessing) can return an assistant-token mask: the loss covers only assistant tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}"
    "{% if message['reasoning_content'] is defined and message['reasoning_content'] %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n' }}{% endif %}"
    "{{ message['content'] }}{{ '<|end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class VerifierError(PipelineError):
    """The verifier cannot be found or loaded; the message says where it looked and the fix."""


def chat_template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def _train_tokenizer(texts: list[str], spec: TinyVerifierBuild):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=[*ROLE_TOKENS, *THINK_TOKENS],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def _train_language_model(profile: Profile, tokenizer, texts: list[str], out: Path) -> dict:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = profile.verifier.build
    assert spec is not None
    seed = profile.run.seed
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=profile.verifier.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=profile.verifier.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
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
    bar = progress(range(spec.train_steps), desc="verifier: train tiny LM", unit="step")
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
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "train_tokens": len(stream),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
    }


def build_tiny_verifier(profile: Profile, out: Path) -> dict[str, Any]:
    spec = profile.verifier.build
    assert spec is not None
    random.seed(profile.run.seed)
    rows = load_prompts(str(spec.corpus), None, "train", None)
    # Texts for the tokenizer are the raw turns; the LM learns the chat-formatted conversations.
    raw = [m["content"] for r in rows for m in r.messages]
    tokenizer = _train_tokenizer(raw, spec)
    texts = [tokenizer.apply_chat_template(list(r.messages), tokenize=False) for r in rows]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    stats = _train_language_model(profile, tokenizer, texts, out)
    tokenizer.save_pretrained(out)
    d = profile.data
    held_out = load_prompts(d.eval_dataset, d.eval_revision, d.eval_split, 16)
    stats["greedy_check"] = greedy_continuation_report(
        out, [r.first_exchange_prompt() for r in held_out], max_new_tokens=48
    )
    return {
        **stats,
        "corpus": data_revision(str(spec.corpus), None),
        "corpus_rows": len(rows),
        "vocab_size": len(tokenizer),
    }


def is_degenerate(tokens: list[int], max_period: int = 8, min_distinct: int = 8) -> bool:
    """True for a constant, near-constant, or short-loop continuation."""
    if len(set(tokens)) < min_distinct:
        return True
    tail = tokens[len(tokens) // 2 :]
    return any(
        all(tail[i] == tail[i + period] for i in range(len(tail) - period))
        for period in range(1, max_period + 1)
    )


def greedy_continuation_report(model_dir: Path, prompts: list[list[dict]], max_new_tokens: int):
    """Greedy-decode each prompt with transformers; count degenerate continuations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    degenerate = 0
    samples = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        degenerate += is_degenerate(new)
        if len(samples) < 3:
            samples.append(tokenizer.decode(new))
    return {"prompts": len(prompts), "degenerate": degenerate, "samples": samples}


def _check_local_config(profile: Profile, folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    for key in ("hidden_size", "num_hidden_layers"):
        want = getattr(profile.verifier, key)
        if cfg.get(key) != want:
            raise ValueError(
                f"verifier.{key}={want} in the profile but {folder}/config.json says "
                f"{cfg.get(key)}; fix the profile to match the model"
            )


def _previous_build(profile: Profile) -> dict[str, Any] | None:
    """The finished manifest of a build from the same recipe, seed and corpus, if any."""
    if profile.verifier.build is None:
        return None
    try:
        m = stage_manifest(profile, "verifier")
    except StageInputError:
        return None
    same = (
        m.outputs.recipe_version == RECIPE_VERSION
        and m.config["verifier"] == profile.dump()["verifier"]
        and m.config["run"]["seed"] == profile.run.seed
        and m.outputs.corpus == data_revision(str(profile.verifier.build.corpus), None)
    )
    built = (Path(verifier_path(profile)) / "config.json").exists()
    return m.model_dump(mode="json", exclude_unset=True) if same and built else None


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "verifier")
    folder.mkdir(parents=True, exist_ok=True)
    path = verifier_path(profile)
    extra: dict[str, Any] = {}
    previous = _previous_build(profile)
    if previous is not None:
        log.info("verifier: %s was built from this exact recipe; reusing it", path)
        return previous
    if profile.verifier.build is not None:
        extra = build_tiny_verifier(profile, Path(path))
    elif Path(path).is_dir():
        _check_local_config(profile, Path(path))
    elif looks_like_path(path):
        raise VerifierError(
            f"verifier.model={path!r}: no such folder; point it at a model folder (with "
            "config.json) or at a Hub id such as moonshotai/Kimi-K2.5"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path,
            revision=profile.verifier.revision,
            trust_remote_code=profile.verifier.trust_remote_code,
        )
    except OSError as err:  # transformers' error for a missing, gated or offline model
        raise VerifierError(
            f"could not load the verifier {path!r} (revision {profile.verifier.revision}): "
            f"{err}. Download it first (`hf download {path}`) into the HF cache, or point "
            "verifier.model at a local folder"
        ) from err
    template = tokenizer.chat_template or ""
    outputs = VerifierOutputs(
        model=path,
        revision=profile.verifier.revision,
        built=profile.verifier.build is not None,
        recipe_version=RECIPE_VERSION if profile.verifier.build is not None else None,
        hidden_size=profile.verifier.hidden_size,
        num_hidden_layers=profile.verifier.num_hidden_layers,
        capture_layer_ids=profile.verifier.capture_layer_ids,
        chat_template_sha256=chat_template_sha256(template),
        **extra,
    )
    return write_manifest(
        profile,
        "verifier",
        started_at=started,
        counts=all_succeeded(1),
        outputs=outputs,
        data_revision=extra.get("corpus"),
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("verifier", run, argv)


if __name__ == "__main__":
    main()
