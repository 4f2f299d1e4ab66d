"""The planner reproduces the team's hero-run figures from their inputs, refuses a run that
cannot fit with remedies that do, and, after a finished run, plans per prompt read (the tiny
run's own check is in tests/test_plan_e2e.py)."""

import subprocess
import sys

import pytest

from pipeline.core.config import load_profile
from pipeline.extract import bytes_per_token
from pipeline.tools.plan import TB, build_plan, planned_samples
from tests.helpers import stand_in_manifest

pytestmark = pytest.mark.unit
KIMI = "configs/kimi-k2.5.yaml"
TINY = "configs/tiny.yaml"
# The team's figures are bf16's: the shipped profile chose fp8 hidden states to fit its 3 TB
# (test_gpu_path.py checks that plan), and these tests check the plan that led there.
BF16 = ["extract.hidden_states_format=verifier_dtype"]
ON_3TB = ["plan.target_volume_free_tb=3", *BF16]


def test_bytes_per_token_for_kimi_is_4_layers_of_7168_bf16():
    assert bytes_per_token(load_profile(KIMI, BF16)) == 57_344


def test_team_figures_from_their_inputs():
    plan = build_plan(load_profile(KIMI, ON_3TB))
    local, rental = plan["machines"]
    assert plan["total_tokens"] == 100_000_000  # 25K samples x 4K tokens
    assert plan["hidden_state_bytes"] == pytest.approx(5.73 * TB, rel=0.01)
    assert local["hours"]["extraction"] == pytest.approx(9.5, abs=0.1)  # 100M at 2,912 tok/s
    assert local["hours"]["training"] == pytest.approx(5.8, abs=0.1)
    assert rental["cost_usd"] == pytest.approx(rental["total_hours"] * 40)
    assert not plan["fits"]
    ten_k = build_plan(load_profile(KIMI, [*ON_3TB, "data.max_samples=10000"]))
    assert ten_k["machines"][0]["hours"]["inference"] == pytest.approx(5.4, abs=0.1)
    assert ten_k["machines"][0]["hours"]["extraction"] == pytest.approx(3.8, abs=0.1)


def test_remedies_come_with_figures_and_switches_that_fit():
    plan = build_plan(load_profile(KIMI, ON_3TB))
    budget = plan["free_bytes"] - plan["reserve_bytes"]
    switches = [r["switch"] for r in plan["remedies"]]
    assert [s.split("=")[0] for s in switches] == [
        "extract.mode",
        "extract.hidden_states_format",
        "extract.max_seq_len",
        "data.max_samples",
    ]
    for remedy in plan["remedies"]:
        assert remedy["fits"] and remedy["hidden_state_bytes"] <= budget, remedy
        # Each switch is a real profile field: applied, the run fits.
        assert build_plan(load_profile(KIMI, [*ON_3TB, remedy["switch"]]))["fits"], remedy
    fp8 = plan["remedies"][1]
    assert fp8["hidden_state_bytes"] == plan["hidden_state_bytes"] // 2


def test_online_stores_nothing_and_extracts_every_epoch():
    offline = build_plan(load_profile(KIMI, ON_3TB))
    online = build_plan(load_profile(KIMI, [*ON_3TB, "extract.mode=online"]))
    assert online["hidden_state_bytes"] == 0 and online["fits"] and not online["remedies"]
    epochs = load_profile(KIMI, BF16).train.epochs
    for off, on in zip(offline["machines"], online["machines"], strict=True):
        assert on["hours"]["extraction"] == pytest.approx(epochs * off["hours"]["extraction"])


def test_check_refuses_to_start_and_prints_the_table():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.plan", "--check", "--config", KIMI, *ON_3TB],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "data.max_samples=" in proc.stdout
    assert "57,344" in proc.stdout


def test_tiny_profile_fits_here():
    assert build_plan(load_profile("configs/tiny.yaml"))["fits"]


def finished_stage(profile, stage, wall_time_s, counts, outputs):
    stand_in_manifest(profile, stage, counts=counts, wall_time_s=wall_time_s, **outputs)


def test_measured_figures_are_per_prompt_read_across_skips_and_multi_turn_rows(tmp_path):
    """320 prompts read, 20 skipped, the 300 kept split into 360 rows (multi-turn): the plan for
    the same 320 prompts is exactly what the run wrote (hidden states, and its generate and
    extract times), and for half as many, half of it."""
    profile = load_profile(TINY, [f"run.output_dir={tmp_path}"])
    tokens, completion = 40_000, 27_000
    finished_stage(
        profile,
        "generate",
        60,
        # Two empty lines are counted as input but are no prompt: the sampling record says
        # what data.max_samples drew.
        {"input": 322, "succeeded": 300, "skipped": 22, "failed": 0,
         "skip_reasons": {"empty_line": 2, "truncated_response": 20},
         "completion_tokens": completion},
        {"responses": "responses.jsonl", "replicas": [{"finished": 320, "failed": 0}],
         "sampling": {"method": "all", "by_source": {"a": {"available": 200, "sampled": 200},
                                                     "b": {"available": 120, "sampled": 120}}}},
    )  # fmt: skip
    finished_stage(
        profile,
        "extract",
        90,
        {"input": 370, "succeeded": 360, "skipped": 10, "failed": 0, "conversations": 300},
        {"rows": 360, "tokens": tokens, "hidden_state_bytes": tokens * bytes_per_token(profile)},
    )
    plan = build_plan(profile)
    assert plan["samples"] == 320  # the rows of the shipped prompt set
    assert plan["total_tokens"] == pytest.approx(tokens)
    assert plan["hidden_state_bytes"] == pytest.approx(tokens * bytes_per_token(profile))
    assert "measured (extract" in plan["tokens_per_sample"].source
    local = plan["machines"][0]["hours"]
    assert local["inference"] * 3600 == pytest.approx(60, rel=0.01)
    assert local["extraction"] * 3600 == pytest.approx(90, rel=0.01)

    half = build_plan(load_profile(TINY, [f"run.output_dir={tmp_path}", "data.max_samples=160"]))
    assert half["samples"] == 160
    assert half["hidden_state_bytes"] == pytest.approx(plan["hidden_state_bytes"] / 2)
    # data.max_samples above the set's size reads the whole set: 320 prompts, not 1000.
    capped = load_profile(TINY, [f"run.output_dir={tmp_path}", "data.max_samples=1000"])
    assert build_plan(capped)["samples"] == 320

    # On a volume too small for it, each remedy's switch, applied, fits: extract.max_seq_len
    # caps each of the 1.125 rows per prompt, not the prompt.
    small = [f"run.output_dir={tmp_path}", "plan.target_volume_free_tb=0.0006"]
    tight = build_plan(load_profile(TINY, small))
    assert not tight["fits"] and tight["remedies"]
    for remedy in tight["remedies"]:
        assert build_plan(load_profile(TINY, [*small, remedy["switch"]]))["fits"], remedy


def test_a_generate_rerun_that_found_all_done_measures_no_rate(tmp_path):
    """Its counts cover the whole file but its wall time is a moment (a run that crashed after
    its last record, before its manifest): no rate from it."""
    profile = load_profile(TINY, [f"run.output_dir={tmp_path}"])
    finished_stage(
        profile,
        "generate",
        0.01,
        {"input": 320, "succeeded": 320, "skipped": 0, "failed": 0, "skip_reasons": {},
         "completion_tokens": 32_000},
        {"responses": "responses.jsonl", "replicas": [],
         "sampling": {"method": "all", "by_source": {"a": {"available": 320, "sampled": 320}}}},
    )  # fmt: skip
    plan = build_plan(profile)
    assert plan["completion_tokens_per_sample"].value == 100
    rate = profile.plan.machines[0].generate_tokens_per_s  # the assumed one
    assert plan["machines"][0]["hours"]["inference"] * 3600 == pytest.approx(32_000 / rate)


def test_prompts_the_verifier_writes_are_planned_like_the_set_s():
    base = load_profile("configs/smollm2-135m.yaml")
    more = load_profile("configs/smollm2-135m.yaml", ["data.self_written.count=5000"])
    assert planned_samples(base) == 320 + 96  # the shipped set and the profile's own count
    assert planned_samples(more) == 320 + 5000


HERO_500K = "configs/kimi-k2.5-500k.yaml"


def cluster_rows(plan, nodes):
    return {r["placement"]: r for r in plan["cluster"]["rows"] if r["nodes"] == nodes}


def test_the_500k_hero_figures_from_their_inputs():
    """500K samples for 3 epochs at the B300 rates: about 1.75B generated and 2.0B extracted
    tokens, 115 TB of bf16 hidden states (57 TB fp8), 73 h over the 5 Gbps link, about 138
    node-hours: 5.8 days on one node, 1.4-2.2 days on four."""
    plan = build_plan(load_profile(HERO_500K, ON_3TB))
    assert plan["samples"] == 500_000
    assert plan["total_tokens"] == 2_000_000_000
    assert plan["completion_tokens"] == 1_750_000_000
    assert plan["hidden_state_bytes"] == pytest.approx(114.7 * TB, rel=0.001)
    fp8 = build_plan(load_profile(HERO_500K, [*ON_3TB, "extract.hidden_states_format=fp8"]))
    assert fp8["hidden_state_bytes"] == pytest.approx(57.3 * TB, rel=0.001)
    assert plan["transfer_hours"] == pytest.approx(72.8, abs=0.1)
    one = cluster_rows(plan, 1)["training_node"]
    assert one["node_hours"] == pytest.approx(138.4, abs=0.1)
    assert one["wall_hours"] / 24 == pytest.approx(5.8, abs=0.05)
    assert not one["fits"]  # 115 TB on one node's 30 TB
    four = cluster_rows(plan, 4)
    shared, local = four["shared_filesystem"], four["node_local"]
    assert shared["wall_hours"] / 24 == pytest.approx(2.2, abs=0.05) and shared.get("chosen")
    assert local["wall_hours"] / 24 == pytest.approx(1.44, abs=0.01)
    # More nodes buy time, not money: the same node-hours on one node or four.
    assert shared["node_hours"] == pytest.approx(one["node_hours"], rel=0.001)
    assert shared["fabric_bytes"] == pytest.approx(4 * plan["hidden_state_bytes"])  # 1 + 3 epochs
    assert local["hidden_state_bytes_per_disk"] == pytest.approx(plan["hidden_state_bytes"] / 4)


def test_training_across_nodes_only_where_the_fabric_keeps_up():
    """A 2.6B-parameter drafter's fp32 gradient all-reduce against an 18 steps/s step."""
    plan = build_plan(load_profile(HERO_500K, ON_3TB))
    local = cluster_rows(plan, 4)["node_local"]
    assert local["allreduce_s"] >= local["step_s"] and "does not pay" in local["refused"]
    half = build_plan(load_profile(HERO_500K, [*ON_3TB, "plan.cluster.gradient_bytes=2"]))
    local = cluster_rows(half, 4)["node_local"]
    assert local["allreduce_s"] < local["step_s"] and not local["refused"]
    # Faster, but not chosen: training from node-local shards is not run by the pipeline yet.
    assert not local["supported"] and not local.get("chosen")
    assert cluster_rows(half, 4)["shared_filesystem"].get("chosen")


def test_hidden_states_over_a_slow_link_are_refused():
    slow = ["plan.cluster.fabric_gbps=5", "plan.cluster.nodes=[4]"]
    plan = build_plan(load_profile(HERO_500K, [*ON_3TB, *slow]))
    shared = cluster_rows(plan, 4)["shared_filesystem"]
    assert "slower than extracting them" in shared["refused"]
    assert not any(r.get("chosen") for r in plan["cluster"]["rows"])
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.plan", "--config", HERO_500K, "--check",
         *ON_3TB, *slow],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "on 4 nodes no placement of the hidden states is left" in proc.stderr
