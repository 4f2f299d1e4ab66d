"""Manifests, resume bookkeeping, the degeneracy check, and the adapters' upstream contracts."""

import inspect
import json
from pathlib import Path

import pytest

from pipeline.build_verifier import is_degenerate
from pipeline.config import load_profile
from pipeline.generate import ResponseWriter, finished_ids
from pipeline.manifest import StageInputError, atomic_write_json, read_manifest, write_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "m.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_manifest_records_provenance_and_a_missing_stage_names_its_target(tmp_path):
    profile = load_profile("configs/tiny.yaml", [f"run.output_dir={tmp_path}"])
    with pytest.raises(StageInputError, match="make generate"):
        read_manifest(profile, "generate")
    (tmp_path / "tiny" / "generate").mkdir(parents=True)
    (tmp_path / "tiny" / "generate" / "x.bin").write_bytes(b"0" * 10)
    import datetime as dt

    m = write_manifest(
        profile,
        "generate",
        started_at=dt.datetime.now(dt.UTC),
        counts={"input": 1, "succeeded": 1, "skipped": 0, "failed": 0},
        outputs={},
    )
    assert read_manifest(profile, "generate") == m
    assert m["bytes"] == 10 and m["config"]["run"]["name"] == "tiny"
    assert {"torch", "speculators", "transformers"} <= set(m["packages"])
    assert "sha" in m["git"]


def test_torn_last_record_is_dropped_on_resume(tmp_path):
    path = tmp_path / "responses.jsonl"
    writer = ResponseWriter(path)
    writer.write({"id": "a"})
    writer.write({"id": "b"})
    writer.close()
    with open(path, "ab") as fh:
        fh.write(b'{"id": "c", "conv')  # a crash mid-write
    assert finished_ids(path) == {"a", "b"}
    assert path.read_text().endswith("}\n")


@pytest.mark.parametrize(
    ("tokens", "degenerate"),
    [
        ([5] * 40, True),
        ([1, 2, 3] * 14, True),
        ([9, 8, *range(10, 18)] + [1, 2, 3, 4] * 8, True),
        (list(range(40)), False),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 3, 5, 7, 9, 11, 2, 4, 6, 8, 10, 12, 13, 14], False),
    ],
)
def test_degeneracy_check(tokens, degenerate):
    assert is_degenerate(tokens) is degenerate


def _words(source: str) -> set[str]:
    import re

    return set(re.findall(r"(?:self\.|def )\w+", source))


def test_hidden_state_connectors_rely_only_on_stock_connector_internals_that_exist():
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

    from pipeline.hidden_states_connector import STOCK_ATTRIBUTES

    source = inspect.getsource(m.ExampleHiddenStatesConnector)
    missing = [
        a for a in STOCK_ATTRIBUTES if f"self.{a}" not in source and f"def {a}" not in source
    ]
    assert not missing, f"vLLM's stock connector no longer has {missing}"


def test_speculators_cpu_adapter_targets_exist():
    from pipeline.speculators_train import check_patch_targets

    check_patch_targets()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/no/such/verifier/folder", "no such folder"),
        ("no-such-org/no-such-verifier", "Download it first"),
    ],
)
def test_missing_verifier_names_the_model_and_the_fix(tmp_path, model, message):
    from pipeline import build_verifier

    profile = load_profile(
        REPO / "configs" / "kimi-k2.5.yaml",
        [f"run.output_dir={tmp_path}", f"verifier.model={model}"],
    )
    with pytest.raises(build_verifier.VerifierError, match=message) as info:
        build_verifier.run(profile)
    assert model in str(info.value)


@pytest.mark.parametrize(
    ("content", "reasoning", "finish", "overrides", "reason"),
    [
        ("", None, "stop", [], "empty_response"),
        ("  ", "thinking...", "length", [], "reasoning_only_response"),
        ("", "thinking...", "stop", ["generate.keep_reasoning_only=true"], None),
        ("an answer", None, "length", [], None),
        ("an answer", None, "length", ["generate.on_truncated=skip"], "truncated_response"),
        ("an answer", "thinking...", "stop", ["generate.on_truncated=skip"], None),
    ],
)
def test_reply_skip_policy(content, reasoning, finish, overrides, reason):
    from pipeline.generate import skip_reason

    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    assert skip_reason(profile, content, reasoning, finish) == reason
