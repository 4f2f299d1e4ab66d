"""The whole tiny pipeline, for real: `make hero-run` on the tiny profile in a temporary run folder.

Real vLLM servers on 127.0.0.1 (generate, extract, eval), real speculators data generation and
training, real safetensors. Then: the drafter trained here beats the same drafter untrained,
in vLLM, on the same held-out prompts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.manifest import STAGES, read_manifest
from tests.helpers import TEST_OVERRIDES

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


def eval_results(profile) -> dict:
    return json.loads((profile.run.run_dir / "eval" / "results.json").read_text())


def test_eval_swept_k_and_methods_at_each_concurrency(tiny_run):
    profile = tiny_run
    results = eval_results(profile)
    e = profile.eval
    arms = [(r["method"], r["k"]) for r in results["runs"]]
    assert arms == [("baseline", None)] + [
        (m, k) for m in e.methods for k in e.num_speculative_tokens
    ]
    for run in results["runs"]:
        assert [lv["concurrency"] for lv in run["levels"]] == e.concurrency
        for level in run["levels"]:
            assert level["output_tokens"] > 0 and level["time_per_output_token_s"] > 0
            if run["method"] == "baseline":
                assert level["acceptance"] is None
                continue
            acc = level["acceptance"]
            assert acc["num_speculative_tokens"] == run["k"]
            assert len(acc["per_position_acceptance"]) == run["k"]
            assert acc["mean_acceptance_length"] == 1 + acc["accepted_tokens"] / acc["drafts"]
            assert level["speedup"] > 0
    summary = results["summary"]
    assert (
        summary["method"] == "eagle3"
        and summary["num_speculative_tokens"] in e.num_speculative_tokens
    )
    assert summary["accepted_tokens"] > 0 and summary["mean_acceptance_length"] > 1.3
    # The same prompts, the same k: EAGLE-3 against vLLM's ngram drafter, in one run.
    assert summary["eagle3_over_ngram_acceptance_length"] == (
        summary["mean_acceptance_length"] / summary["ngram_mean_acceptance_length"]
    )


def test_eval_measured_every_category(tiny_run):
    results = eval_results(tiny_run)
    per_category = results["per_category"]
    assert len(per_category) == 8 and sum(c["prompts"] for c in per_category.values()) == 24
    for row in per_category.values():
        assert set(row["mean_acceptance_length"]) == set(tiny_run.eval.methods)
        assert row["speedup"]["eagle3"] > 0
    level = results["runs"][-1]["levels"][0]
    assert sum(c["output_tokens"] for c in level["per_category"].values()) == level["output_tokens"]


def test_eval_is_lossless(tiny_run):
    results = eval_results(tiny_run)
    for run in results["runs"][1:]:
        level = run["levels"][0]  # batch size 1: greedy outputs must be token-identical
        assert level["mismatched_prompt_ids"] == [], (run["method"], run["k"])
    outputs = json.loads((tiny_run.run.run_dir / "eval" / "outputs.json").read_text())
    assert all(o["token_ids"] for o in outputs["baseline-c1"].values())
    assert outputs["eagle3-k3-c1"].keys() == outputs["baseline-c1"].keys()
    lm_eval = results["lm_eval"]
    assert lm_eval["lossless"], lm_eval
    task = lm_eval["tasks"]["eval_reference_continuation"]
    assert task["documents"] >= 20 and task["scores_without_drafter"]["chrf"] > 0


def test_eval_wrote_the_table_and_plots(tiny_run):
    folder = tiny_run.run.run_dir / "eval"
    results = eval_results(tiny_run)
    files = [p["file"] for p in results["plots"]]
    assert files == [
        "acceptance_per_position.png",
        "acceptance_length_by_k.png",
        "speedup_by_category.png",
    ]
    for name in files:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "results.md").read_text()
    assert "| eagle3 | 3 | 1 |" in table and "| ngram | 1 | 4 |" in table
    assert "| humanities |" in table and "eval_reference_continuation" in table


def test_card_reloads_with_the_measured_numbers(tiny_run):
    from huggingface_hub import ModelCard

    profile = tiny_run
    card = ModelCard.load(profile.run.run_dir / "card" / "README.md")
    summary = json.loads((profile.run.run_dir / "eval" / "results.json").read_text())["summary"]
    assert card.data.license == "apache-2.0"  # derived from the built verifier's license
    assert {"eagle3", "speculative-decoding", "speculators"} <= set(card.data.tags)
    assert card.data.library_name == "speculators"
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics["mean_acceptance_length"] == round(summary["mean_acceptance_length"], 4)
    assert metrics["acceptance_rate"] == round(summary["acceptance_rate"], 4)
    assert f"{summary['mean_acceptance_length']:.3f}" in card.text
    assert "--speculative-config" in card.text
    # The data table: one row per source actually generated, with the checked license and counts.
    report = json.loads((profile.run.run_dir / "licenses" / "report.json").read_text())
    for source in report["sources"]:
        row = f"| {source['source']} | {source['dataset']} |"
        assert row in card.text and f"| {source['rows']} | {source['prompt_tokens']} |" in card.text
    for plot in read_manifest(profile, "card")["outputs"]["plots"]:
        assert f"]({plot})" in card.text


def test_an_untrained_drafter_is_an_error_not_a_result(tiny_run, tmp_path):
    from eval.eval_prompts import load_eval_prompts
    from eval.measure_acceptance import Arm, EvalError, check_acceptance, measure_level
    from pipeline.build_verifier import resolved_verifier
    from pipeline.train import train_command
    from pipeline.vllm_server import vllm_server

    profile = tiny_run
    untrained = tmp_path / "untrained"
    prepared = profile.run.run_dir / "train" / "data"
    verifier = resolved_verifier(profile)["model"]
    cmd = train_command(profile, verifier, prepared, untrained)
    subprocess.run([*cmd, "--dry-run"], cwd=REPO, check=True, capture_output=True, timeout=600)
    drafter = next(p for p in [untrained, *untrained.iterdir()] if (p / "config.json").exists())
    arm = Arm("eagle3", 3)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    with vllm_server(profile, verifier, tmp_path / "vllm.log", speculative_config=spec) as ep:
        level = measure_level(ep, profile, load_eval_prompts(profile)[:8], arm, 1)
    assert level["acceptance"]["mean_acceptance_length"] < 1.05  # random init: about 1.0
    with pytest.raises(EvalError, match="untrained or miswired drafter") as info:
        check_acceptance(arm, level, profile.eval.min_acceptance_length)
    assert "below eval.min_acceptance_length=1.1" in str(info.value)
    trained = next(
        r for r in eval_results(profile)["runs"] if r["method"] == "eagle3" and r["k"] == 3
    )
    assert trained["levels"][0]["acceptance"]["mean_acceptance_length"] > 1.3


def test_a_drafter_reading_the_wrong_layers_is_refused(tiny_run, tmp_path):
    import shutil

    from pipeline.config import load_profile
    from tests.helpers import seed_run_dir

    overrides = [f"run.output_dir={tmp_path}", *TEST_OVERRIDES]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    manifest_path = profile.run.run_dir / "train" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    miswired = tmp_path / "miswired-drafter"
    shutil.copytree(manifest["outputs"]["drafter"], miswired)
    config = json.loads((miswired / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    (miswired / "config.json").write_text(json.dumps(config))
    manifest["outputs"]["drafter"] = str(miswired)
    manifest_path.write_text(json.dumps(manifest))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.measure_acceptance",
            "--config",
            "configs/tiny.yaml",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "reads capture layers [0, 2, 5] but its hidden states were captured at [1, 3, 4]" in (
        proc.stderr
    )
    assert not (profile.run.run_dir / "eval" / "manifest.json").exists()


def test_eval_measures_a_running_deployment_by_base_url(tiny_run, tmp_path):
    from pipeline.build_verifier import resolved_verifier
    from pipeline.config import load_profile
    from pipeline.vllm_server import vllm_server
    from tests.helpers import seed_run_dir

    drafter = read_manifest(tiny_run, "train")["outputs"]["drafter"]
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 2}
    verifier = resolved_verifier(tiny_run)["model"]
    with vllm_server(
        tiny_run, verifier, tmp_path / "deployment.log", speculative_config=spec
    ) as ep:
        overrides = [
            f"run.output_dir={tmp_path}",
            f"server.base_url={ep.base_url}",
            "data.eval_max_samples=8",
            "eval.max_tokens=48",
            "eval.concurrency=[1]",
        ]
        profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
        seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
        proc = subprocess.run(
            [
                "make",
                "eval",
                f"BASE_URL={ep.base_url}",
                f"ARGS={' '.join(overrides[:1] + overrides[2:])}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = eval_results(profile)
    assert [r["method"] for r in results["runs"]] == ["served"]
    summary = results["summary"]
    assert summary["num_speculative_tokens"] == 2  # read from the server's own counters
    assert summary["accepted_tokens"] > 0 and "speedup" not in summary
    assert not list((profile.run.run_dir / "eval").glob("vllm-*.log"))  # nothing was started


def test_train_reported_its_steps_for_the_progress_bar(tiny_run):
    from pipeline.train import read_steps

    done, total = read_steps(tiny_run.run.run_dir / "train" / "progress.json")
    manifest = read_manifest(tiny_run, "train")
    assert total == manifest["outputs"]["global_steps"]
    assert total - tiny_run.train.log_every < done <= total
