"""Published EAGLE-3 drafters: read in any layout, checked against the verifier, prepared for
speculators and vLLM; and ours written out in the original EAGLE layout.

Three layouts exist (:func:`read_drafter` tells them apart by config and weight names):

- ``speculators``: ``speculators_config``, ``layers.0.*``; what the train stage writes;
- ``eagle``: the EAGLE authors' and SpecForge's (``LlamaForCausalLM`` or
  ``LlamaForCausalLMEagle3``, ``midlayer.*``, layer ids in ``eagle_config`` or implied as
  2, n//2, n-3, usually no ``embed_tokens``);
- ``eagle-mla``: a DeepSeek-V3 draft layer (``Eagle3DeepseekV2ForCausalLM``), which vLLM serves
  from its own config and speculators cannot train.

:func:`prepare_drafter` writes a drafter in speculators' format that both speculators (to
finetune) and vLLM (to serve) load: speculators' own converter maps an ``eagle`` folder, then
what that converter drops is put back (the ``input_norm`` of ``norm_before_fc``, the draft
layer's sliding window and rope parameters, the draft vocabulary size), and an embedding the
folder lacks is the verifier's, since speculators would otherwise leave it uninitialised.

Invariants: the layer ids a prepared drafter records are vLLM's (a layer's input; SGLang's count
one lower, ``layer_ids_from: sglang`` adds the one); a drafter whose ``fc`` does not read
``len(ids) x`` the verifier's hidden size, whose target vocabulary is not the verifier's, or whose
layer ids lie outside the verifier is refused by name before anything loads it; a prepared
drafter keeps its own draft vocabulary (``d2t``/``t2d``), never one recomputed from our data.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import PretrainedDrafter
from pipeline.core.drafter import aux_layer_ids, drafter_config
from pipeline.core.errors import PipelineError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# What a drafter folder needs from the Hub: its config and single-file weights.
HUB_FILES = ["config.json", *WEIGHT_FILES]
# Draft-layer fields speculators' converter drops or reads only in their older spelling
# (``rope_theta``): the source folder's values are put back.
FIELDS_THE_CONVERTER_DROPS = (
    "sliding_window",
    "layer_types",
    "use_sliding_window",
    "rope_parameters",
)


class PretrainedDrafterError(PipelineError):
    """A pretrained drafter cannot be used: unreadable, another layout, or another verifier's."""


@dataclass(frozen=True)
class DrafterLayout:
    """A drafter folder as read: its layout, config, weight shapes and vLLM-convention layer ids
    (None: the folder names none, and vLLM would use its defaults)."""

    folder: Path
    kind: str  # "speculators", "eagle" or "eagle-mla"
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    layer_ids: list[int] | None

    @property
    def draft_vocab_size(self) -> int:
        return self.shapes["lm_head.weight"][0]

    @property
    def target_vocab_size(self) -> int:
        if "t2d" in self.shapes:
            return self.shapes["t2d"][0]
        layer = self.config.get("transformer_layer_config", self.config)
        return layer["vocab_size"]

    @property
    def fc_input_size(self) -> int:
        return self.shapes["fc.weight"][1]

    @property
    def has_embedding(self) -> bool:
        return "embed_tokens.weight" in self.shapes

    @property
    def full_vocab_maps(self) -> bool:
        """``d2t``/``t2d`` over the whole vocabulary (SpecForge writes them when nothing is
        pruned), which vLLM refuses to load."""
        return "d2t" in self.shapes and self.draft_vocab_size == self.target_vocab_size


def fetch_drafter(source: PretrainedDrafter) -> Path:
    """The drafter's local folder: ``source.path`` itself, or its Hub snapshot (config and
    weights only); offline and not cached is an error naming both ways out."""
    if Path(source.path).is_dir():
        return Path(source.path)
    if Path(source.path).is_absolute() or source.path.startswith("."):
        raise PretrainedDrafterError(f"pretrained drafter {source.path}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(source.path, revision=source.revision, allow_patterns=HUB_FILES)
        )
    except HFValidationError:
        raise PretrainedDrafterError(
            f"pretrained drafter {source.path}: neither a local folder nor a Hub id (owner/name)"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise PretrainedDrafterError(
            f"pretrained drafter {source.path}: not a local folder, and the Hub snapshot is "
            f"unavailable ({type(err).__name__}: {err}); download it while online "
            "(`hf download <id>`) or give the path of a local copy"
        ) from None


def public_name(source: PretrainedDrafter) -> str:
    """How published records name a drafter's source: its Hub id, or its local folder's name
    (never a path of this machine)."""
    return Path(source.path).name if Path(source.path).is_dir() else source.path


def provenance(source: PretrainedDrafter, drafter: DrafterLayout) -> dict[str, Any]:
    """What a manifest or results record of a pretrained drafter: where it came from, in which
    layout and layer-id convention, its draft vocabulary."""
    return {
        "source": public_name(source),
        "revision": source.revision,
        "layout": drafter.kind,
        "layer_ids_from": source.layer_ids_from,
        "draft_vocab_size": drafter.draft_vocab_size,
    }


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    if (folder / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    if (folder / "pytorch_model.bin").is_file():
        import torch

        state = torch.load(folder / "pytorch_model.bin", map_location="meta", weights_only=True)
        return {k: tuple(v.shape) for k, v in state.items()}
    if any(folder.glob("*.index.json")):
        raise PretrainedDrafterError(
            f"{folder}: a sharded checkpoint; EAGLE-3 drafters are one file (model.safetensors "
            "or pytorch_model.bin)"
        )
    raise PretrainedDrafterError(f"{folder}: no model.safetensors or pytorch_model.bin")


def implied_layer_ids(num_layers: int) -> list[int]:
    """The layers EAGLE-3 reads when a drafter names none (EAGLE's and vLLM's rule)."""
    return [2, num_layers // 2, num_layers - 3]


def recorded_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """An original-layout config's layer ids where vLLM looks: the top level, then
    ``eagle_config``."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return config.get("eagle_aux_hidden_state_layer_ids") or nested


def read_drafter(folder: Path, *, layer_ids_from: str = "vllm") -> DrafterLayout:
    """The drafter in ``folder``: its layout and what must match the verifier.
    ``layer_ids_from``: the engine whose convention its recorded layer ids follow."""
    config = drafter_config(folder)
    shapes = _weight_shapes(folder)
    architectures = config.get("architectures") or []
    if "speculators_config" in config:
        kind, ids = "speculators", aux_layer_ids(config)
    elif any("Deepseek" in a for a in architectures):
        kind, ids = "eagle-mla", recorded_layer_ids(config)
    elif any(k.startswith("midlayer.") for k in shapes):
        kind, ids = "eagle", recorded_layer_ids(config)
    else:
        raise PretrainedDrafterError(
            f"{folder}: not an EAGLE-3 drafter this pipeline knows (architectures "
            f"{architectures}, no speculators_config and no midlayer.* weights)"
        )
    for needed in ("lm_head.weight", "fc.weight"):  # EAGLE-3 reads the verifier through fc
        if needed not in shapes:
            raise PretrainedDrafterError(f"{folder}: not an EAGLE-3 drafter, no {needed}")
    if ids is not None and layer_ids_from == "sglang":
        ids = [i + 1 for i in ids]  # SGLang records a layer's output, vLLM the next one's input
    return DrafterLayout(folder, kind, config, shapes, list(ids) if ids is not None else None)


def text_config(verifier_config: dict[str, Any]) -> dict[str, Any]:
    """The verifier's text model config (a multimodal wrapper's ``text_config``)."""
    return verifier_config.get("text_config") or verifier_config


def effective_layer_ids(drafter: DrafterLayout, verifier_config: dict[str, Any]) -> list[int]:
    """The verifier layers vLLM feeds the drafter: its own ids, or the implied ones."""
    layers = text_config(verifier_config)["num_hidden_layers"]
    return drafter.layer_ids if drafter.layer_ids is not None else implied_layer_ids(layers)


def check_fits(
    drafter: DrafterLayout,
    verifier_config: dict[str, Any],
    name: str,
    capture_layer_ids: list[int] | None = None,
) -> list[int]:
    """Refuse a drafter made for another verifier: hidden size, vocabulary, layer ids (and,
    to finetune, the layers extraction captured). Returns the layer ids it reads."""
    text = text_config(verifier_config)
    hidden, vocab, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    ids = effective_layer_ids(drafter, verifier_config)
    where = f"{name} ({drafter.folder})"
    if drafter.fc_input_size != len(ids) * hidden:
        raise PretrainedDrafterError(
            f"{where}: its fc reads {drafter.fc_input_size} features, but {len(ids)} layers of "
            f"this verifier give {len(ids) * hidden} (hidden size {hidden}): a drafter for "
            "another verifier"
        )
    if drafter.target_vocab_size != vocab:
        raise PretrainedDrafterError(
            f"{where}: made for a {drafter.target_vocab_size}-token vocabulary, the verifier has "
            f"{vocab}: a drafter for another tokenizer"
        )
    if not all(0 <= i < layers for i in ids) or len(set(ids)) != len(ids):
        raise PretrainedDrafterError(
            f"{where}: reads layers {ids}, not distinct layers of a {layers}-layer verifier; "
            "give the ids in eagle_config.eagle_aux_hidden_state_layer_ids (and layer_ids_from: "
            "sglang when SGLang trained it)"
        )
    if drafter.kind == "eagle" and len(ids) != 3:
        raise PretrainedDrafterError(
            f"{where}: reads {len(ids)} layers {ids}; an original-layout EAGLE-3 drafter reads 3"
        )
    if capture_layer_ids is not None and ids != capture_layer_ids:
        raise PretrainedDrafterError(
            f"{where}: reads layers {ids}, but extraction captured {capture_layer_ids}; set "
            f"verifier.capture_layer_ids: {ids} and extract again to finetune it"
        )
    return ids


def _load_weights(folder: Path) -> dict[str, Any]:
    from speculators.convert.utils import load_checkpoint_weights

    return load_checkpoint_weights(folder)


def _convert_eagle(drafter: DrafterLayout, out: Path, verifier: str, layer_ids: list[int]) -> None:
    """speculators' converter over an ``eagle`` folder, with every setting it would otherwise
    default: layer ids and the norms (it reads them from kwargs, not the folder)."""
    from speculators.convert.eagle import Eagle3Converter

    c = drafter.config
    nested = c.get("eagle_config") or {}
    source = out.parent / f".{out.name}-source"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    for item in drafter.folder.iterdir():
        if item.name != "config.json":
            (source / item.name).symlink_to(item.resolve())
    # What the converter would otherwise default (32000 tokens, fc over 3 x its own hidden size,
    # float32 unless the older `torch_dtype` is set): the shapes the weights have.
    target_hidden = drafter.fc_input_size // len(layer_ids)
    filled = {
        **c,
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": None if target_hidden == c["hidden_size"] else target_hidden,
        "torch_dtype": c.get("torch_dtype") or c.get("dtype") or "bfloat16",
    }
    atomic_write_json(source / "config.json", filled)
    Eagle3Converter().convert(
        source,
        out,
        verifier,
        validate=False,  # its validation loads the whole verifier
        norm_before_residual=bool(c.get("norm_before_residual", False)),
        norm_before_fc=bool(nested.get("norm_before_fc", c.get("norm_before_fc", False))),
        fc_norm=bool(c.get("fc_norm", False)),
        norm_output=bool(c.get("norm_output", False)),
        eagle_aux_hidden_state_layer_ids=layer_ids,
    )
    shutil.rmtree(source)


def _verifier_embedding(verifier: str) -> Any:
    from speculators.utils.loading import load_model_layers

    return load_model_layers(["embed_tokens.weight"], verifier)["embed_tokens.weight"]


def prepare_drafter(drafter: DrafterLayout, out: Path, verifier: str, layer_ids: list[int]) -> Path:
    """``drafter`` in speculators' format in ``out``, naming ``verifier`` (the folder
    speculators reads) and ``layer_ids``, with an embedding and its own draft vocabulary."""
    if drafter.kind == "eagle-mla":
        raise PretrainedDrafterError(
            f"{drafter.folder}: an MLA drafter (Eagle3DeepseekV2ForCausalLM); speculators trains "
            "Llama draft layers only. Evaluate it as a reference drafter, finetune a Llama one"
        )
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if drafter.kind == "eagle":
        _convert_eagle(drafter, out, verifier, layer_ids)
        weights = _load_weights(out)
        config = drafter_config(out)
        layer = config["transformer_layer_config"]
        for field in FIELDS_THE_CONVERTER_DROPS:
            if field in drafter.config:
                layer[field] = drafter.config[field]
        if "input_norm.weight" in drafter.shapes:  # read again only when the converter dropped it
            weights["input_norm.weight"] = _load_weights(drafter.folder)["input_norm.weight"]
            config["norm_before_fc"] = True
    else:
        weights = _load_weights(drafter.folder)
        config = copy.deepcopy(drafter.config)
    config["draft_vocab_size"] = drafter.draft_vocab_size
    config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    config["speculators_config"]["verifier"]["name_or_path"] = verifier
    if drafter.full_vocab_maps:  # nothing pruned: vLLM loads no maps then, and refuses these
        weights.pop("d2t", None)
        weights.pop("t2d", None)
    if "embed_tokens.weight" not in weights:
        dtype = weights["lm_head.weight"].dtype
        weights["embed_tokens.weight"] = _verifier_embedding(verifier).to(dtype)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")
    atomic_write_json(out / "config.json", config)
    return out


def write_vocab_maps(drafter: Path, folder: Path) -> tuple[Path, Path] | None:
    """A prepared drafter's own ``d2t``/``t2d`` as the .npy files speculators' trainer takes
    (``--d2t-path``/``--t2d-path``); None when it prunes nothing."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(drafter / "model.safetensors", "pt") as f:
        if "d2t" not in f.keys():  # noqa: SIM118
            return None
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / f"d2t-{len(d2t)}.npy", folder / f"t2d-{len(d2t)}.npy"
    np.save(paths[0], d2t.numpy())
    np.save(paths[1], t2d.numpy())
    return paths


def write_eagle_layout(checkpoint: Path, out: Path) -> Path:
    """A speculators-format drafter in the original EAGLE (SpecForge) layout, as published
    drafters come: ``LlamaForCausalLMEagle3`` with its layer ids (vLLM's convention: SGLang
    counts one lower) and norms in the config, ``midlayer.*`` weights, no embedding (the
    verifier's is used). vLLM serves it as it is."""
    from safetensors.torch import save_file

    config = drafter_config(checkpoint)
    layer = dict(config["transformer_layer_config"])
    layer.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=config["draft_vocab_size"],
        norm_before_residual=config.get("norm_before_residual", False),
        norm_output=config.get("norm_output", False),
        target_hidden_size=config.get("target_hidden_size"),
        rope_theta=layer.get("rope_parameters", {}).get("rope_theta", layer.get("rope_theta")),
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
            "use_aux_hidden_state": True,
            "norm_before_fc": config.get("norm_before_fc", False),
        },
        torch_dtype=config.get("dtype", "bfloat16"),
    )
    weights = {
        k.replace("layers.0.", "midlayer.", 1): v
        for k, v in _load_weights(checkpoint).items()
        if k != "embed_tokens.weight"
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")
    atomic_write_json(out / "config.json", layer)
    return out


@dataclass(frozen=True)
class PretrainedStart:
    """What the trainer starts from: the prepared drafter, its own vocabulary maps (as .npy
    files for ``--d2t-path``/``--t2d-path``) and draft vocabulary size, and the manifest's
    record of where it came from."""

    drafter: Path
    d2t: Path
    t2d: Path
    draft_vocab_size: int
    record: dict[str, Any]


def start_from(
    source: PretrainedDrafter,
    verifier_config: dict[str, Any],
    verifier: str,
    capture_layer_ids: list[int],
    folder: Path,
) -> PretrainedStart:
    """``source`` fetched, checked against the verifier and the layers extraction captured,
    and prepared in ``folder`` for speculators (``verifier``: the folder it reads)."""
    name = f"train.from_pretrained {source.path}"
    drafter = read_drafter(fetch_drafter(source), layer_ids_from=source.layer_ids_from)
    ids = check_fits(drafter, verifier_config, name, capture_layer_ids)
    if "d2t" not in drafter.shapes or drafter.full_vocab_maps:
        raise PretrainedDrafterError(
            f"{name}: it prunes no vocabulary (its lm_head covers all "
            f"{drafter.target_vocab_size} tokens); finetuning keeps a drafter's own draft "
            "vocabulary, and vLLM loads no full-vocabulary maps. Train from scratch "
            "(train.from_pretrained: null) with train.draft_vocab_size"
        )
    prepared = prepare_drafter(drafter, folder / "pretrained", verifier, ids)
    maps = write_vocab_maps(prepared, folder / "pretrained-vocab")
    assert maps is not None  # the drafter has d2t and t2d, checked above
    return PretrainedStart(
        drafter=prepared,
        d2t=maps[0],
        t2d=maps[1],
        draft_vocab_size=drafter.draft_vocab_size,
        record={**provenance(source, drafter), "converted": drafter.kind != "speculators"},
    )
