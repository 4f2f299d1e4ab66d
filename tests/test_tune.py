"""The recipe sweep (`tune`): its config, its variants' point runs, its comparison and its plot.

The variants themselves are trained and measured by the train and eval stages, which their own
tests cover; the sweep end to end over the tiny run is in the slow tier (test_tune_e2e.py).
"""

from __future__ import annotations

import pytest
import yaml

from pipeline.core.config import ConfigError, Profile, load_profile
from pipeline.training.point_runs import point_profile, prepare_point
from pipeline.tune import compared, plot, val_accuracy, variant_name

pytestmark = pytest.mark.unit
SMOLLM2 = "configs/smollm2-135m.yaml"


def test_the_sweep_lists_its_variants_one_field_at_a_time():
    profile = load_profile(SMOLLM2, ["tune.learning_rate=[]", "tune.epochs=[2,8]"])
    assert profile.tune.variants() == [("draft_vocab_size", 4096), ("epochs", 2), ("epochs", 8)]


NO_VARIANT = ["tune.draft_vocab_size=[]", "tune.learning_rate=[]", "tune.epochs=[]"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (NO_VARIANT, r"tune names no variant"),
        (["tune.epochs=[4]"], r"tune\.epochs lists 4, the profile's own train\.epochs"),
        (["tune.epochs=[8,8]"], r"tune\.epochs lists a value twice"),
        (["extract.mode=online"], r"none are stored: use extract\.mode: offline"),
        (["train.max_steps=100"], r"train\.max_steps stops every variant at the same step"),
        (["train.max_train_tokens=1000"], r"drop train\.max_train_tokens"),
        (["tune.learning_rate=[0]"], r"greater than 0"),
    ],
)
def test_a_sweep_that_measures_nothing_new_is_refused_with_its_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_profile(SMOLLM2, overrides)


def test_a_variant_is_the_run_with_one_training_field_changed(tmp_path):
    profile = load_profile(SMOLLM2, [f"run.output_dir={tmp_path}", "tune.learning_rate=[0.003]"])
    for stage in ("verifier", "generate", "extract"):
        (profile.run.run_dir / stage).mkdir(parents=True)
    name = variant_name("learning_rate", 0.003)
    point = point_profile(profile, "tune", name, {"learning_rate": 0.003}, 1)
    assert point.run.run_dir == profile.run.run_dir / "tune" / "learning_rate-0.003"
    changed = {
        key
        for key, value in point.train.model_dump().items()
        if value != getattr(profile.train, key)
    }
    assert changed == {"learning_rate"}
    assert point.data == profile.data and point.tune is None and point.data_curve is None
    assert point.eval.methods == ["eagle3"] and point.eval.num_speculative_tokens == [1]
    config = prepare_point(profile, point)
    assert Profile.model_validate(yaml.safe_load(config.read_text())) == point
    assert (point.run.run_dir / "extract").resolve() == profile.run.run_dir / "extract"


def test_a_variant_is_compared_with_the_runs_own_drafter_and_plotted(tmp_path):
    base = {
        "mean_acceptance_length": 1.43,
        "speedup": 1.24,
        "val_metrics": {"full_acc_0_epoch": 0.4},
    }
    base["val_accuracy"] = val_accuracy(base)
    variant = {
        "field": "epochs",
        "value": 8,
        "mean_acceptance_length": 1.5,
        "speedup": None,  # not measured: no difference is made up
        "val_metrics": {"full_acc_0_epoch": 0.45},
    }
    variant["val_accuracy"] = val_accuracy(variant)
    assert compared(variant, base)["delta"] == {
        "mean_acceptance_length": 0.07,
        "val_accuracy": 0.05,
    }
    assert val_accuracy({"val_metrics": None}) is None
    plot(base, [compared(variant, base)], 1, tmp_path / "tune.png")
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
