"""`make gpu-smoke`: skipped cleanly without a device; its torch phase on a machine with torch
alone; its pipeline phase's profile and command lines as far as the CPU goes; its checks, run
for real on the CPU (--allow-cpu) over the session's tiny run; all of it on a GPU when there is
one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.core.config import load_profile
from pipeline.serving.vllm_api import server_args
from pipeline.tools.gpu_smoke import pipeline_phase
from tests.helpers import seed_run_dir, stage_env
from tests.test_gpu_path import vllm_parsed

REPO = Path(__file__).parent.parent
# What a bare CUDA machine lacks: everything but torch (and the standard library).
BLOCKED = ("vllm", "speculators", "transformers", "pydantic", "yaml", "safetensors", "datasets")
BARE = (
    "import runpy, sys\n"
    f"for name in {BLOCKED!r}:\n"
    "    sys.modules[name] = None  # import fails, as where it is not installed\n"
    "sys.argv = ['gpu_smoke', *sys.argv[1:]]\n"
    "runpy.run_module('pipeline.tools.gpu_smoke', run_name='__main__')\n"
)


def smoke(*flags: str, bare: bool = False) -> subprocess.CompletedProcess:
    head = ["-c", BARE] if bare else ["-m", "pipeline.tools.gpu_smoke"]
    return subprocess.run(
        [sys.executable, *head, *flags],
        cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a device is visible: nothing to skip")
def test_without_a_device_it_says_skipped_and_succeeds(tmp_path):
    proc = smoke("--out", str(tmp_path / "smoke"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-smoke: skipped: no CUDA device visible")
    assert not any(tmp_path.iterdir())  # nothing read, nothing written


@pytest.mark.unit
def test_with_torch_alone_the_torch_phase_runs_and_the_rest_is_skipped_by_name(tmp_path):
    out = tmp_path / "smoke"
    proc = smoke("--allow-cpu", "--out", str(out), bare=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    torch_phase = report["phases"]["torch"]
    assert torch_phase["bf16_matmul_rel_error"] < 0.02
    assert torch_phase["flex_attention"]["max_rel_difference"] < 1e-5
    assert "safetensors_round_trip" not in torch_phase  # not installed: not tried
    for phase in ("pipeline", "checks"):
        assert report["phases"][phase]["skipped"].startswith("needs vllm, speculators")
    assert "skipped pipeline, checks (needs vllm" in proc.stdout


@pytest.mark.unit
def test_the_pipeline_phase_runs_the_tiny_gpu_profile_smoke_sized(tmp_path):
    overrides, profile = pipeline_phase.profile_for(
        "configs/tiny-gpu.yaml", [], tmp_path / "gpu-smoke"
    )
    assert profile.run.run_dir == tmp_path / "gpu-smoke"
    assert profile.train.max_steps == pipeline_phase.TRAIN_STEPS
    assert profile.eval.methods == ["ngram", "eagle3"] and profile.eval.concurrency == [1]
    assert profile.server.attention_backend == "TRITON_MLA" and not profile.server.enforce_eager
    # The server it starts, as far as the CPU goes: vLLM's own parser takes the CUDA line.
    engine = vllm_parsed(server_args(profile, "verifier/model", 8000, platform="cuda"))
    assert engine.dtype == "bfloat16" and not engine.enforce_eager
    # Every stage it runs is a Make target's module.
    makefile = (REPO / "Makefile").read_text()
    for _, module in pipeline_phase.STAGES:
        assert f"$(STAGE) {module} " in makefile, module
    assert all(o in overrides for o in pipeline_phase.SMOKE_OVERRIDES)


def check_report(out: Path, device: str) -> None:
    report = json.loads((out / "report.json").read_text())
    assert report["device"] == device and "failed" not in report, report.get("failed")
    checks = report["phases"]["checks"]
    capture = checks["capture"]
    assert len(capture["shards"]) == 8 and capture["min_cosine"] >= capture["threshold"]
    assert checks["training"]["global_steps"] > 0
    decoding = checks["decoding"]
    assert decoding["greedy_outputs_identical"] is True
    assert decoding["eagle3_mean_acceptance_length"] > 1
    assert decoding["ngram_mean_acceptance_length"] > 1
    if device == "cuda":  # the kernels and server features a CPU cannot run
        assert checks["servers"], "no eval server log read"
        assert checks["training"]["kernels"] == {
            "--draft-attn-impl": "simple_flex_attention",
            "--loss-implementation": "fused",
        }
        assert report["phases"]["torch"]["flex_attention"]["backward"]


@pytest.mark.e2e
def test_the_checks_pass_on_the_cpu_and_catch_wrong_hidden_states(tiny_run, tmp_path):
    profile = load_profile(REPO / "configs" / "tiny.yaml", [f"run.output_dir={tmp_path}"])
    seed_run_dir(tiny_run, profile, ("verifier", "extract", "train", "eval"))
    out = profile.run.run_dir
    proc = smoke("--allow-cpu", "--phases", "checks", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_report(out, "cpu")

    # Stored hidden states that are not the verifier's: named, with the measured agreement.
    shard = out / "extract" / "prepared" / "hidden_states" / "hs_3.safetensors"
    tensors = load_file(shard)
    tensors["hidden_states"] = torch.flip(tensors["hidden_states"], dims=[0]).contiguous()
    save_file(tensors, shard)
    proc = smoke("--allow-cpu", "--phases", "checks", "--out", str(out))
    assert proc.returncode == 2
    assert "differ from the stored ones: min cosine" in proc.stderr
    assert "differ from the stored ones" in json.loads((out / "report.json").read_text())["failed"]


@pytest.mark.gpu
def test_the_smoke_passes_on_the_gpu_from_nothing(tmp_path):
    proc = smoke("--out", str(tmp_path / "gpu-smoke"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_report(tmp_path / "gpu-smoke", "cuda")
