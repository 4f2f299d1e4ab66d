"""The recipe sweep on the tiny run, for real: each variant trained by speculators with one
training field changed and measured in vLLM by the eval stage, compared with the run's own
drafter, plotted and on the card, and a rerun that keeps every finished variant.

Slow tier (a few minutes on 2 cores over the tiny run): the real-model profile runs it in
`make real-demo`; the default tier checks the config, the variants' point runs, the comparison
and the plot without training (tests/test_tune.py).
"""

from __future__ import annotations

import subprocess

import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest, stage_dir
from tests.helpers import REPO, TEST_OVERRIDES, seed_run_dir, stage_command, stage_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SEEDED = ("verifier", "generate", "licenses", "extract", "train", "eval")


def test_each_variant_is_trained_measured_compared_and_shown_on_the_card(tiny_run, tmp_path):
    overrides = [
        *TEST_OVERRIDES,
        f"run.output_dir={tmp_path}",
        "tune.draft_vocab_size=[512]",
        "tune.epochs=[3]",
    ]
    profile = load_profile(REPO / "configs/tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, SEEDED)

    def sweep() -> subprocess.CompletedProcess:
        return subprocess.run(
            stage_command("pipeline.tune", *overrides),
            cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=1800,
        )  # fmt: skip

    done = sweep()
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = read_manifest(profile, "tune")["outputs"]
    assert outputs["base"]["run"] == "."
    assert [(v["field"], v["value"]) for v in outputs["variants"]] == [
        ("draft_vocab_size", 512),
        ("epochs", 3),
    ]
    for variant in outputs["variants"]:
        run_dir = stage_dir(profile, "tune") / variant["run"]
        trained = read_manifest(load_profile(run_dir / "profile.yaml"), "train")
        assert trained["config"]["train"][variant["field"]] == variant["value"]
        assert trained["outputs"]["training_data"]["whole"]
        assert variant["mean_acceptance_length"] >= 1.0
        assert variant["delta"]["mean_acceptance_length"] == pytest.approx(
            variant["mean_acceptance_length"] - outputs["base"]["mean_acceptance_length"],
            abs=1e-3,
        )
    smaller = read_manifest(
        load_profile(stage_dir(profile, "tune") / outputs["variants"][0]["run"] / "profile.yaml"),
        "train",
    )
    assert smaller["outputs"]["draft_vocab_size"] == 512

    made = (stage_dir(profile, "tune") / "epochs-3" / "eval" / "manifest.json").stat()
    again = sweep()
    assert again.returncode == 0, again.stderr[-3000:]
    kept = (stage_dir(profile, "tune") / "epochs-3" / "eval" / "manifest.json").stat()
    assert kept.st_mtime_ns == made.st_mtime_ns, "a finished variant was measured again"

    card = subprocess.run(
        stage_command("model_card.card", *overrides),
        cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert card.returncode == 0, card.stderr[-3000:]
    text = (stage_dir(profile, "card") / "README.md").read_text()
    assert "## Which recipe" in text and "`epochs` 3" in text
    assert (stage_dir(profile, "card") / outputs["plot"]).is_file()
