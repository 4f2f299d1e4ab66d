"""`make gpu-smoke`: skipped cleanly without a device; its checks, run for real on the CPU
(--allow-cpu) over the session's tiny run, and on a GPU when there is one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.core.config import load_profile
from tests.helpers import run_stage, seed_run_dir

REPO = Path(__file__).parent.parent


def smoke(profile_overrides: list[str], *flags: str) -> subprocess.CompletedProcess:
    return run_stage("pipeline.tools.gpu_smoke", *flags, *profile_overrides)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a device is visible: nothing to skip")
def test_without_a_device_it_says_skipped_and_succeeds(tmp_path):
    proc = smoke([f"run.output_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-smoke: skipped: no CUDA device visible")
    assert not any(tmp_path.iterdir())  # nothing read, nothing written


def check_report(run_dir: Path, device: str) -> None:
    report = json.loads((run_dir / "gpu-smoke" / "report.json").read_text())
    assert report["device"] == device
    capture = report["capture"]
    assert len(capture["shards"]) == 8 and capture["min_cosine"] >= capture["threshold"]
    train = report["train"]
    assert train["global_steps"] == train["total_steps"] > 0
    assert (Path(train["checkpoint"]) / "config.json").exists()
    assert "--epochs" in train["command"]
    if device == "cuda":  # the kernels a CPU cannot run
        assert train["draft_attn_impl"] == "simple_flex_attention"
        assert train["loss_implementation"] == "fused"


@pytest.mark.e2e
def test_the_smoke_path_passes_on_the_cpu_and_catches_wrong_hidden_states(tiny_run, tmp_path):
    profile = load_profile(REPO / "configs" / "tiny.yaml", [f"run.output_dir={tmp_path}"])
    seed_run_dir(tiny_run, profile, ("verifier", "extract"))
    overrides = [f"run.output_dir={tmp_path}"]
    proc = smoke(overrides, "--allow-cpu", "--rows", "32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_report(profile.run.run_dir, "cpu")

    # Stored hidden states that are not the verifier's: named, with the measured agreement.
    shard = profile.run.run_dir / "extract" / "prepared" / "hidden_states" / "hs_3.safetensors"
    tensors = load_file(shard)
    tensors["hidden_states"] = torch.flip(tensors["hidden_states"], dims=[0]).contiguous()
    save_file(tensors, shard)
    proc = smoke(overrides, "--allow-cpu", "--rows", "32")
    assert proc.returncode == 2
    assert "differ from the stored ones: min cosine" in proc.stderr


@pytest.mark.gpu
def test_the_smoke_passes_on_the_gpu(tiny_run, tmp_path):
    profile = load_profile(REPO / "configs" / "tiny.yaml", [f"run.output_dir={tmp_path}"])
    seed_run_dir(tiny_run, profile, ("verifier", "extract"))
    proc = smoke([f"run.output_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_report(profile.run.run_dir, "cuda")
