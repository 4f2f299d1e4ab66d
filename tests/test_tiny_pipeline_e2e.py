"""The whole tiny pipeline, for real: `make hero-run` on the tiny profile in a temporary run folder.

Real vLLM servers on 127.0.0.1 (generate, extract, eval), real speculators data generation and
training, real safetensors. Then: the drafter trained here beats the same drafter untrained,
in vLLM, on the same held-out prompts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.manifest import STAGES, read_manifest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent


def test_every_stage_wrote_a_complete_manifest(tiny_run):
    profile = tiny_run
    for stage in STAGES:
        m = read_manifest(profile, stage)
        c = m["counts"]
        assert c["succeeded"] + c["skipped"] + c["failed"] == c["input"], stage
        assert sum(c.get("skip_reasons", {}).values()) == c["skipped"]
        assert m["git"]["sha"] and m["packages"]["speculators"] == "0.9.0"
        assert m["config"]["run"]["output_dir"] == str(profile.run.output_dir)


def test_the_built_verifier_is_not_degenerate(tiny_run):
    profile = tiny_run
    check = read_manifest(profile, "verifier")["outputs"]["greedy_check"]
    assert check["degenerate"] <= check["prompts"] // 4, check


def test_generate_regenerated_every_prompt(tiny_run):
    profile = tiny_run
    c = read_manifest(profile, "generate")["counts"]
    assert c["input"] == 320 and c["failed"] == 0 and c["succeeded"] >= 300
    lines = (profile.run.run_dir / "generate" / "responses.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 320


def test_hidden_state_bytes_match_the_formula(tiny_run):
    profile = tiny_run
    out = read_manifest(profile, "extract")["outputs"]
    layers = [*profile.verifier.capture_layer_ids, profile.verifier.num_hidden_layers]
    assert out["captured_layer_ids"] == layers
    per_token = len(layers) * profile.verifier.hidden_size * 4  # float32
    assert (
        out["hidden_state_bytes"] == out["tokens"] * per_token == out["expected_hidden_state_bytes"]
    )
    hs = sorted((profile.run.run_dir / "extract" / "prepared" / "hidden_states").glob("hs_*"))
    assert len(hs) == out["rows"]
    with safe_open(hs[0], framework="pt") as f:
        states, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    assert states.shape == (ids.shape[0], len(layers), profile.verifier.hidden_size)


def test_eval_measured_acceptance_losslessly(tiny_run):
    profile = tiny_run
    summary = json.loads((profile.run.run_dir / "eval" / "results.json").read_text())["summary"]
    assert summary["num_speculative_tokens"] == 3
    assert summary["accepted_tokens"] > 0 and summary["mean_acceptance_length"] > 1.3
    assert len(summary["per_position_acceptance"]) == 3
    assert summary["greedy_outputs_identical"], summary["mismatched_prompt_ids"]
    assert summary["speedup"] > 0


def test_card_reloads_with_the_measured_numbers(tiny_run):
    from huggingface_hub import ModelCard

    profile = tiny_run
    card = ModelCard.load(profile.run.run_dir / "card" / "README.md")
    summary = json.loads((profile.run.run_dir / "eval" / "results.json").read_text())["summary"]
    assert card.data.license == "apache-2.0"
    assert "eagle3" in card.data.tags and card.data.library_name == "speculators"
    assert f"{summary['mean_acceptance_length']:.3f}" in card.text
    assert "--speculative-config" in card.text


def test_trained_drafter_beats_the_untrained_one_in_vllm(tiny_run, tmp_path):
    from eval.measure_acceptance import eval_prompts, measure_run
    from pipeline.build_verifier import resolved_verifier
    from pipeline.train import train_command

    profile = tiny_run
    untrained = tmp_path / "untrained"
    prepared = profile.run.run_dir / "train" / "data"
    cmd = train_command(profile, resolved_verifier(profile)["model"], prepared, untrained)
    subprocess.run([*cmd, "--dry-run"], cwd=REPO, check=True, capture_output=True, timeout=600)
    drafter = next(p for p in [untrained, *untrained.iterdir()] if (p / "config.json").exists())
    rows = eval_prompts(profile)
    random_init = measure_run(profile, rows, tmp_path / "vllm.log", str(drafter))
    trained = json.loads((profile.run.run_dir / "eval" / "results.json").read_text())["summary"]
    assert trained["mean_acceptance_length"] > random_init["mean_acceptance_length"] + 0.3, (
        trained["mean_acceptance_length"],
        random_init["mean_acceptance_length"],
    )


def test_train_reported_its_steps_for_the_progress_bar(tiny_run):
    from pipeline.train import read_steps

    done, total = read_steps(tiny_run.run.run_dir / "train" / "progress.json")
    manifest = read_manifest(tiny_run, "train")
    assert total == manifest["outputs"]["global_steps"]
    assert total - tiny_run.train.log_every < done <= total
