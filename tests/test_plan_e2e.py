"""`make plan` after a finished tiny run predicts the hidden-state bytes that run wrote.

The tiny run's multi-turn conversations make more training rows than prompts, and generate may
skip some prompts; the plan must count per prompt read so that the figure still matches.
"""

import pytest

from pipeline.core.manifest import read_manifest, stage_dir
from pipeline.extract import hidden_state_bytes
from pipeline.tools.plan import build_plan

pytestmark = pytest.mark.e2e


def test_plan_after_the_tiny_run_predicts_its_hidden_state_bytes(tiny_run):
    written = hidden_state_bytes(stage_dir(tiny_run, "extract") / "prepared" / "hidden_states")
    extract = read_manifest(tiny_run, "extract")
    assert written["hidden_state_bytes"] == extract["outputs"]["hidden_state_bytes"] > 0
    plan = build_plan(tiny_run)
    assert plan["samples"] == read_manifest(tiny_run, "generate")["counts"]["input"]
    assert plan["hidden_state_bytes"] == pytest.approx(written["hidden_state_bytes"], rel=0.02)
    extraction_s = plan["machines"][0]["hours"]["extraction"] * 3600
    assert extraction_s == pytest.approx(extract["wall_time_s"], rel=0.02)
