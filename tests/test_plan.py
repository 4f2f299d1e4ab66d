"""The planner reproduces the team's hero-run figures from their inputs, and refuses a run that
cannot fit with remedies that do."""

import subprocess
import sys

import pytest

from pipeline.config import load_profile
from pipeline.extract import bytes_per_token
from pipeline.plan import TB, build_plan

pytestmark = pytest.mark.unit
KIMI = "configs/kimi-k2.5.yaml"
ON_3TB = ["plan.target_volume_free_tb=3"]


def test_bytes_per_token_for_kimi_is_4_layers_of_7168_bf16():
    assert bytes_per_token(load_profile(KIMI)) == 57_344


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
    epochs = load_profile(KIMI).train.epochs
    for off, on in zip(offline["machines"], online["machines"], strict=True):
        assert on["hours"]["extraction"] == pytest.approx(epochs * off["hours"]["extraction"])


def test_check_refuses_to_start_and_prints_the_table():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.plan", "--check", "--config", KIMI, *ON_3TB],
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
