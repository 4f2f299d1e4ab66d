"""The typed contract between stages: declared inputs, hashed, and one refusal of stale ones."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from pipeline.core.atomic_files import sha256_file
from pipeline.core.config import load_profile
from pipeline.core.contracts import CONTRACTS, STAGES, GenerateOutputs
from pipeline.core.manifest import (
    StageInputError,
    manifest_path,
    read_input,
    stage_dir,
    write_manifest,
)
from tests.helpers import stand_in_manifest, stand_in_outputs

pytestmark = pytest.mark.unit


@pytest.fixture
def profile(tmp_path):
    return load_profile("configs/tiny.yaml", [f"run.output_dir={tmp_path}"])


def finish(profile, stage: str) -> dict:
    """``stage`` written through write_manifest, its declared inputs as they are on disk."""
    stage_dir(profile, stage).mkdir(parents=True, exist_ok=True)
    return write_manifest(
        profile,
        stage,
        started_at=dt.datetime.now(dt.UTC),
        counts={"input": 1, "succeeded": 1, "skipped": 0, "failed": 0},
        outputs=stand_in_outputs(stage),
    )


def test_every_stage_declares_inputs_that_come_before_it():
    order = list(CONTRACTS)
    for name, contract in CONTRACTS.items():
        for needed in contract.inputs:
            assert order.index(needed) < order.index(name), (name, needed)
    assert STAGES[0] == "verifier" and STAGES[-1] == "publish" and "bench" not in STAGES


def test_a_manifest_records_the_sha256_of_each_declared_input(profile):
    stand_in_manifest(profile, "verifier", model="v")
    written = finish(profile, "generate")
    record = written["inputs"]["verifier"]
    assert record["sha256"] == sha256_file(manifest_path(profile, "verifier"))
    assert set(written["inputs"]) == set(CONTRACTS["generate"].inputs)
    on_disk = json.loads(manifest_path(profile, "generate").read_text())
    assert on_disk["inputs"]["verifier"]["manifest"] == "verifier/manifest.json"  # portable


def test_a_stage_rerun_makes_every_manifest_made_from_it_stale(profile):
    stand_in_manifest(profile, "verifier", model="v")
    finish(profile, "generate")
    finish(profile, "licenses")
    assert read_input(profile, "card", "licenses").outputs.passed is False  # current: readable
    rerun = json.loads(manifest_path(profile, "generate").read_text())
    rerun["counts"]["input"] = 2  # rerun with another result: the license check is of old data
    manifest_path(profile, "generate").write_text(json.dumps(rerun))
    with pytest.raises(StageInputError) as info:
        read_input(profile, "card", "licenses")
    message = str(info.value)
    assert "stage 'licenses' of run 'tiny' is stale: its input 'generate' was rerun" in message
    assert "rerun `make licenses" in message


def test_an_undeclared_input_is_refused(profile):
    stand_in_manifest(profile, "verifier", model="v")
    with pytest.raises(ValueError, match="reads 'verifier' without declaring it"):
        read_input(profile, "licenses", "verifier")


def test_a_manifest_off_its_contract_names_the_field_and_the_target(profile):
    stand_in_manifest(profile, "verifier", model="v")
    finish(profile, "generate")
    path = manifest_path(profile, "generate")
    manifest = json.loads(path.read_text())
    manifest["outputs"]["responses_file"] = manifest["outputs"].pop("responses")
    path.write_text(json.dumps(manifest))
    with pytest.raises(StageInputError) as info:
        read_input(profile, "extract", "generate")
    message = str(info.value)
    assert "does not match the 'generate' stage's contract" in message
    assert "outputs.responses" in message and "rerun `make generate" in message


def test_write_manifest_takes_only_the_stage_s_own_outputs(profile):
    stand_in_manifest(profile, "verifier", model="v")
    stage_dir(profile, "licenses").mkdir(parents=True)
    with pytest.raises(TypeError, match="writes LicensesOutputs"):
        write_manifest(
            profile,
            "licenses",
            started_at=dt.datetime.now(dt.UTC),
            counts={},
            outputs=GenerateOutputs(responses="r", skipped="s", sampling={}, replicas=[]),
        )


def test_staleness_is_checked_up_the_whole_pipeline(profile):
    """A regenerated data set makes extract stale, so train (made from extract) is refused
    too, though train's own input manifests are unchanged."""
    stand_in_manifest(profile, "verifier", model="v")
    for stage in ("generate", "extract", "train"):
        finish(profile, stage)
    assert read_input(profile, "eval", "train")
    rerun = json.loads(manifest_path(profile, "generate").read_text())
    rerun["counts"]["input"] = 2  # another result
    manifest_path(profile, "generate").write_text(json.dumps(rerun))
    with pytest.raises(StageInputError, match="stage 'extract' of run 'tiny' is stale"):
        read_input(profile, "eval", "train")


def test_a_rerun_with_the_same_result_keeps_its_manifest(profile):
    stand_in_manifest(profile, "verifier", model="v")
    first = finish(profile, "generate")
    before = manifest_path(profile, "generate").read_bytes()
    again = finish(profile, "generate")
    assert manifest_path(profile, "generate").read_bytes() == before  # nothing after it stale
    assert again == first


def test_an_input_rerun_while_the_stage_ran_leaves_the_stage_stale(profile):
    stand_in_manifest(profile, "verifier", model="v")
    finish(profile, "generate")
    read_input(profile, "licenses", "generate")  # the stage reads its input ...
    rerun = json.loads(manifest_path(profile, "generate").read_text())
    rerun["counts"]["input"] = 2
    manifest_path(profile, "generate").write_text(json.dumps(rerun))  # ... which is rerun ...
    finish(profile, "licenses")  # ... before the stage finishes: it records what it read
    with pytest.raises(StageInputError, match="stage 'licenses' of run 'tiny' is stale"):
        read_input(profile, "card", "licenses")
