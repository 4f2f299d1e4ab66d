"""Reading a published drafter: what is not one, or cannot be had offline, is named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pipeline.core.config import PretrainedDrafter
from pipeline.training.pretrained_drafter import (
    PretrainedDrafterError,
    fetch_drafter,
    read_drafter,
)

pytestmark = pytest.mark.unit


def test_a_drafter_that_cannot_be_had_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(PretrainedDrafterError, match="no such folder"):
        fetch_drafter(PretrainedDrafter(path=str(tmp_path / "gone")))
    with pytest.raises(PretrainedDrafterError, match="neither a local folder nor a Hub id"):
        fetch_drafter(PretrainedDrafter(path="a/b/c"))
    with pytest.raises(PretrainedDrafterError) as info:
        fetch_drafter(PretrainedDrafter(path="nobody/no-drafter"))
    assert "the Hub snapshot is unavailable" in str(info.value)
    assert "download it while online" in str(info.value)


def test_what_is_not_an_eagle3_drafter_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(
        PretrainedDrafterError, match=r"no model\.safetensors or pytorch_model\.bin"
    ):
        read_drafter(tmp_path)
    save_file({"model.layers.0.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(PretrainedDrafterError, match="not an EAGLE-3 drafter this pipeline knows"):
        read_drafter(tmp_path)
    save_file({"midlayer.x": torch.zeros(2), "lm_head.weight": torch.zeros(4, 2)},
              tmp_path / "model.safetensors")  # fmt: skip
    with pytest.raises(PretrainedDrafterError, match=r"not an EAGLE-3 drafter, no fc\.weight"):
        read_drafter(tmp_path)
