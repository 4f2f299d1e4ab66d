"""Hidden-state shards as the connector writes them, read back by speculators' own loaders."""

from __future__ import annotations

import re

import pytest
import torch
from hs_connectors.transfer import FileTransfer, FP8Transfer
from safetensors import safe_open

from pipeline.core.config import load_profile
from pipeline.extract import ExtractError, check_shard_format
from pipeline.serving.hidden_states_connector import write_shard

pytestmark = pytest.mark.unit


def shard(tokens: int = 64, layers: int = 4, hidden: int = 128) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hidden_states = (
        torch.randn(tokens, layers, hidden) * torch.logspace(-2, 3, tokens)[:, None, None]
    )
    return {"hidden_states": hidden_states, "token_ids": torch.arange(tokens, dtype=torch.int64)}


def test_fp8_shard_is_half_the_bytes_and_reads_back_within_fp8_precision(tmp_path):
    tensors = shard()
    assert write_shard(tensors, str(tmp_path / "hs_0.safetensors"), 0, fp8=True)
    assert write_shard(tensors, str(tmp_path / "full" / "hs_0.safetensors"), 0)
    with safe_open(tmp_path / "hs_0.safetensors", framework="pt") as f:
        assert f.get_slice("hidden_states").get_dtype() == "F8_E4M3"
        assert f.get_slice("hidden_states_scales").get_shape() == [64, 1, 1]
    restored = FP8Transfer(tmp_path, dequantize_dtype=torch.float32).get_cached(0)
    assert set(restored) == {"hidden_states", "token_ids"}
    assert torch.equal(restored["token_ids"], tensors["token_ids"])
    # Per-token scales keep every token's relative error at e4m3's, across 5 decades of scale.
    original = tensors["hidden_states"]
    error = (restored["hidden_states"] - original).abs().amax(dim=(1, 2))
    assert (error / original.abs().amax(dim=(1, 2))).max() < 0.07
    full = FileTransfer(tmp_path / "full").get_cached(0)
    assert torch.equal(full["hidden_states"], original)


def test_non_finite_hidden_states_are_not_written(tmp_path):
    tensors = shard()
    tensors["hidden_states"][3, 1, 7] = float("nan")
    assert not write_shard(tensors, str(tmp_path / "hs_0.safetensors"), 0, fp8=True)
    assert list(tmp_path.iterdir()) == []


def test_a_format_change_over_existing_shards_is_refused(tmp_path):
    assert write_shard(shard(), str(tmp_path / "hs_0.safetensors"), 0)
    fp8 = load_profile("configs/tiny.yaml", ["extract.hidden_states_format=fp8"])
    with pytest.raises(ExtractError, match=re.escape("extract.hidden_states_format=fp8; delete")):
        check_shard_format(tmp_path, fp8)
    check_shard_format(tmp_path, load_profile("configs/tiny.yaml"))
