"""The planner's two storage remedies as real profile switches, end to end on the tiny profile.

``extract.mode=online`` with ``extract.hidden_states_format=fp8``: extract only tokenises and
stores no hidden states; train serves the verifier as an extraction server on 127.0.0.1, and
speculators generates each row's hidden states on demand, quantised to fp8 by our connector and
dequantised by speculators' fp8 backend, and deletes them once loaded.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest
from tests.helpers import run_stage, seed_run_dir

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
STEPS = 20


def stage(name: str, overrides: list[str]) -> subprocess.CompletedProcess:
    return run_stage(f"pipeline.{name}", *overrides, timeout=900)


def test_online_fp8_training_stores_no_hidden_states(tiny_generated, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        "extract.mode=online",
        "extract.hidden_states_format=fp8",
        "train.epochs=1",
        "train.log_every=5",
        f'train.extra_args=["--max-steps", "{STEPS}"]',
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_generated, profile, ("verifier", "generate"))

    extracted = stage("extract", overrides)
    assert extracted.returncode == 0, extracted.stderr
    extract = read_manifest(profile, "extract")["outputs"]
    assert extract["mode"] == "online" and extract["dtype"] == "float8_e4m3fn"
    assert extract["rows"] > 0 and extract["hidden_state_bytes"] == extract["files"] == 0
    assert not (profile.run.run_dir / "extract" / "prepared" / "hidden_states").exists()

    trained = stage("train", overrides)
    assert trained.returncode == 0, trained.stderr
    train = read_manifest(profile, "train")["outputs"]
    hidden_states = train["hidden_states"]
    assert hidden_states["mode"] == "online" and hidden_states["dtype"] == "float8_e4m3fn"
    # The server ran at least one packed sequence's worth of rows per step for training.
    assert hidden_states["tokens_generated_online"] >= STEPS * 100
    assert train["global_steps"] == STEPS
    command = " ".join(train["command"])
    assert "--on-missing generate" in command and "--hidden-states-backend fp8" in command
    assert (Path(train["drafter"]) / "model.safetensors").exists()
    folder = profile.run.run_dir / "train"
    # Every generated shard was loaded and deleted.
    assert not list((folder / "online-staging").rglob("*.safetensors"))
    assert "not written" not in (folder / "vllm.log").read_text()
