"""The verifier as speculators can load it: a multimodal wrapper seen as its text model.

speculators' ``prepare-data`` and training load the verifier's processor with ``AutoProcessor``
and its embedding and LM head from its safetensors. On a wrapper such as Kimi-K2.5
(``KimiK25ForConditionalGeneration`` with a nested ``text_config``) ``AutoProcessor`` resolves
the image processor, which wants torchvision (or Moonshot's remote vision code), though
speculators needs only the tokenizer. So both are handed a *text view*: a folder of links to the
verifier's own files in which ``config.json`` is the text model's config and nothing names a
processor, so ``AutoProcessor`` returns the tokenizer. The hero (a Hub id) takes the same route:
the view links the snapshot's small files and the shards that hold the embedding and LM head.

:func:`text_model` loads the same text model in transformers (the hidden-state checks use it).

Invariants: the view links, never copies, weights; a verifier without ``text_config`` is used as
it is; the view is rebuilt on every call (it is cheap), so it always matches the verifier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.drafter import drafter_config

# Files that make AutoProcessor resolve a multimodal processor; the view leaves them out.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# What a view needs from a Hub snapshot besides the shards that hold embedding and LM head.
SMALL_FILES = ["*.json", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
HEAD_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
INDEX = "model.safetensors.index.json"


def _snapshot(model: str, revision: str | None) -> Path:
    """The local snapshot of a Hub verifier with what the view needs (a download when absent)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    folder = Path(snapshot_download(model, revision=revision, allow_patterns=SMALL_FILES))
    if (folder / INDEX).exists():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        shards = {f for k, f in weight_map.items() if k.endswith(HEAD_WEIGHTS)}
        for shard in sorted(shards):
            hf_hub_download(model, shard, revision=revision)
    return folder


def _source(model: str, revision: str | None) -> Path:
    """The verifier's folder: ``model`` itself, or its Hub snapshot."""
    return Path(model) if Path(model).is_dir() else _snapshot(model, revision)


def text_view(model: str, revision: str | None, folder: Path) -> str:
    """The path to hand speculators for ``model``: ``folder`` as its text view when ``model``
    is a multimodal wrapper, else ``model`` itself."""
    source = _source(model, revision)
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config")
    if not isinstance(text, dict):
        return model
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for entry in sorted(source.iterdir()):
        if entry.name in ("config.json", "tokenizer_config.json", *PROCESSOR_FILES):
            continue
        (folder / entry.name).symlink_to(entry.resolve())
    tokenizer_config = source / "tokenizer_config.json"
    if tokenizer_config.exists():
        tok = json.loads(tokenizer_config.read_text())
        tok.pop("processor_class", None)
        atomic_write_json(folder / "tokenizer_config.json", tok)
    if text.get("model_type") == "kimi_k2":
        # transformers reads Kimi's text model as DeepSeek-V3, as its own Kimi-K2.5 config does
        text = {**text, "model_type": "deepseek_v3"}
    atomic_write_json(folder / "config.json", text)
    return str(folder)


def text_model(model: str, revision: str | None, folder: Path, **kwargs: Any):
    """The verifier's text model in transformers (for a wrapper, through its text view, its
    weights read without the ``language_model.`` prefix); ``kwargs`` go to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    path = text_view(model, revision, folder)
    mapping = {r"^language_model\.": ""} if path != model else None
    return AutoModelForCausalLM.from_pretrained(path, key_mapping=mapping, **kwargs).eval()


def name_verifier(drafter: Path, model: str, verifier_config: dict) -> None:
    """Make a drafter trained against a text view name the verifier itself: its id or path and
    its own architectures (e.g. ``KimiK25ForConditionalGeneration``), not the view's."""
    config = drafter_config(drafter)
    named = config.get("speculators_config", {}).get("verifier")
    if not isinstance(named, dict):
        return
    named["name_or_path"] = model
    if verifier_config.get("architectures"):
        named["architectures"] = verifier_config["architectures"]
    atomic_write_json(drafter / "config.json", config)


def verifier_config(model: str, revision: str | None) -> dict:
    """The verifier's own top-level config.json."""
    return json.loads((_source(model, revision) / "config.json").read_text())
