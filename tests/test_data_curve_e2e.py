"""The data curve on the tiny run, for real: a drafter trained by speculators on each budget of
the extracted data and measured in vLLM by the eval stage, the curve plotted and on the card,
and a rerun that keeps every finished point.

Slow tier (a few minutes on 2 cores over the tiny run): the real-model profile runs it in
`make real-demo` and tests/test_smollm2_run_e2e.py; the default tier checks the budgets, the
views speculators reads and the point runs without training (tests/test_token_budget.py).
"""

from __future__ import annotations

import subprocess

import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest, stage_dir
from tests.helpers import REPO, TEST_OVERRIDES, seed_run_dir, stage_command, stage_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SEEDED = ("verifier", "generate", "licenses", "extract", "train", "eval")


def test_the_curve_trains_and_measures_each_budget_and_the_card_shows_it(tiny_run, tmp_path):
    overrides = [
        *TEST_OVERRIDES,
        f"run.output_dir={tmp_path}",
        "data_curve.train_tokens=[5000,20000,100000000]",
    ]
    profile = load_profile(REPO / "configs/tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, SEEDED)

    def curve() -> subprocess.CompletedProcess:
        return subprocess.run(
            stage_command("pipeline.data_curve", *overrides),
            cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=1800,
        )  # fmt: skip

    done = curve()
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = read_manifest(profile, "data_curve")["outputs"]
    points = outputs["points"]
    assert len(points) == 3  # two budgets, then the whole training split for the third
    assert points[0]["train_tokens"] <= 5000 < points[1]["train_tokens"] <= 20000
    assert [u["train_tokens"] for u in outputs["not_reached"]] == [100000000]
    validation_rows = set()
    for point in points:
        run_dir = stage_dir(profile, "data_curve") / point["run"]
        own = point["run"] == "."  # the whole split: the seeded run's own drafter and eval
        trained_by = profile if own else load_profile(run_dir / "profile.yaml")
        trained = read_manifest(trained_by, "train")["outputs"]
        used = trained["training_data"]
        assert used["tokens"] == point["train_tokens"] <= used["available_tokens"]
        validation_rows.add(used["validation_rows"])
        assert point["mean_acceptance_length"] >= 1.0
    assert len(validation_rows) == 1, "every point is validated on the same rows"
    assert used["whole"]

    assert points[-1]["run"] == ".", "the whole split is the run's own drafter, not trained again"
    made = (stage_dir(profile, "data_curve") / points[0]["run"] / "eval" / "manifest.json").stat()
    again = curve()
    assert again.returncode == 0, again.stderr[-3000:]
    kept = (stage_dir(profile, "data_curve") / points[0]["run"] / "eval" / "manifest.json").stat()
    assert kept.st_mtime_ns == made.st_mtime_ns, "a finished point was measured again"

    card = subprocess.run(
        stage_command("model_card.card", *overrides),
        cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert card.returncode == 0, card.stderr[-3000:]
    text = (stage_dir(profile, "card") / "README.md").read_text()
    assert "## How much data" in text and "was not reached" in text
    assert (stage_dir(profile, "card") / outputs["plot"]).is_file()
