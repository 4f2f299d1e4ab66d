"""vLLM as a hidden-state extractor: its server flags, and what the captured states cost.

The verifier is served with vLLM's ``extract_hidden_states`` speculative method and the
project's KV connector (:mod:`pipeline.serving.hidden_states_connector`), which writes each
request's hidden states at the capture layers as a safetensors shard. Extraction (offline) and
training (online) start the same server with :func:`server_flags`.

Invariant: captured layer ids are ``verifier.capture_layer_ids + [num_hidden_layers]`` (the
last layer's output before the final norm), and one token costs
``len(captured layers) x hidden size x element bytes`` of hidden states (:func:`bytes_per_token`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile
from pipeline.core.serving_platform import Platform, server_platform

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CONNECTOR_MODULE = "pipeline.serving.hidden_states_connector"


def captured_layer_ids(profile: Profile) -> list[int]:
    """EAGLE-3 aux layers plus the last layer's output, before the final norm."""
    return [*profile.verifier.capture_layer_ids, profile.verifier.num_hidden_layers]


def element_bytes(profile: Profile) -> int:
    """Bytes per stored hidden-state value: 1 for fp8, else the verifier dtype's."""
    if profile.extract.hidden_states_format == "fp8":
        return 1
    return DTYPE_BYTES[profile.verifier.dtype]


def stored_dtype(profile: Profile) -> str:
    return (
        "float8_e4m3fn" if profile.extract.hidden_states_format == "fp8" else profile.verifier.dtype
    )


def bytes_per_token(profile: Profile, dtype_bytes: int | None = None) -> int:
    """Hidden-state bytes one token costs: captured layers x hidden size x element bytes.

    fp8 shards also hold one float32 scale (4 bytes) per token, and every shard holds
    8 bytes of token id per token; neither is a hidden state, so neither is counted here.
    """
    width = dtype_bytes or element_bytes(profile)
    return len(captured_layer_ids(profile)) * profile.verifier.hidden_size * width


def reserve_bytes(profile: Profile) -> int:
    return int(profile.extract.disk_reserve_gib * 2**30)


def server_flags(
    profile: Profile, staging: Path, platform: Platform | None = None
) -> dict[str, Any]:
    """The speculative and KV-transfer configs that turn vLLM into a hidden-state extractor on
    ``platform`` (default: where the profile's servers run)."""
    cpu = (platform or server_platform(profile)) == "cpu"
    name = "CpuHiddenStatesConnector" if cpu else "ReservedHiddenStatesConnector"
    kv = {
        "kv_connector": name,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(staging),
            "disk_reserve_bytes": reserve_bytes(profile),
            "hidden_states_format": profile.extract.hidden_states_format,
        },
    }
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": captured_layer_ids(profile)}
        },
    }
    return {"speculative_config": spec, "kv_transfer_config": kv}


def clear_staging(staging: Path) -> None:
    """Drop what a killed server left in staging; only finished shards in the dataset count."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
