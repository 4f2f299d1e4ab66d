"""Manifests, resume bookkeeping, the degeneracy check, and the adapters' upstream contracts."""

import inspect
import json
from pathlib import Path

import pytest

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import load_profile
from pipeline.core.manifest import StageInputError, read_manifest, write_manifest
from pipeline.core.portable import portable_drafter
from pipeline.generate import ResponseWriter, finished_ids
from pipeline.verifier import is_degenerate
from tests.helpers import stand_in_manifest, stand_in_outputs

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

    stand_in_manifest(profile, "verifier")
    m = write_manifest(
        profile,
        "generate",
        started_at=dt.datetime.now(dt.UTC),
        counts={"input": 1, "succeeded": 1, "skipped": 0, "failed": 0},
        outputs=stand_in_outputs("generate"),
    )
    assert read_manifest(profile, "generate") == m
    assert m["bytes"] == 10 and m["config"]["run"]["name"] == "tiny"
    assert {"torch", "speculators", "transformers"} <= set(m["packages"])
    assert "sha" in m["git"]


def write_paths_manifest(profile, drafter, command, **named):
    """A train manifest with paths in its typed fields, and ``named`` ones in a free-form one."""
    import datetime as dt

    for stage in ("verifier", "extract"):
        stand_in_manifest(profile, stage)
    (profile.run.run_dir / "train").mkdir(parents=True, exist_ok=True)
    return write_manifest(
        profile,
        "train",
        started_at=dt.datetime.now(dt.UTC),
        counts={"input": 1, "succeeded": 1, "skipped": 0, "failed": 0},
        outputs=stand_in_outputs("train", drafter=drafter, command=command, verifier=named),
    )


def test_manifests_record_no_path_of_this_machine_and_read_back_absolute(tmp_path):
    import shutil
    import sys

    profile = load_profile("configs/tiny.yaml", [f"run.output_dir={tmp_path / 'a'}"])
    run_dir = profile.run.run_dir
    drafter = str(run_dir / "train/checkpoints/3")
    command = [sys.executable, "-m", "x", "--save-path", str(run_dir / "train/ck")]
    named = {
        "cache": str(Path.home() / ".cache/huggingface"),
        "corpus": str(REPO / "data/prompts/tiny-blend.jsonl"),
        "spec": json.dumps({"model": str(run_dir / "train/checkpoints/3")}),
        "hub_id": "moonshotai/Kimi-K2.5",
        "url": "http://127.0.0.1:8000/v1",
    }
    m = write_paths_manifest(profile, drafter, command, **named)
    text = (run_dir / "train/manifest.json").read_text()
    on_disk = json.loads(text)
    for machine_path in (str(tmp_path), str(REPO), str(Path.home()), sys.prefix):
        assert machine_path not in text
    assert on_disk["outputs"]["drafter"] == "train/checkpoints/3"
    assert on_disk["inputs"]["verifier"]["manifest"] == "verifier/manifest.json"
    assert on_disk["config"]["run"]["output_dir"] == ".."
    written = on_disk["outputs"]["verifier"]
    assert written["corpus"] == "data/prompts/tiny-blend.jsonl"
    assert written["spec"] == json.dumps({"model": "<run>/train/checkpoints/3"})
    assert written["hub_id"] == named["hub_id"]
    assert written["url"] == named["url"]
    assert on_disk["relative_paths"]["/outputs/drafter"] == "run"
    assert on_disk["relative_paths"]["/outputs/verifier/corpus"] == "repo"

    # Read back on this machine: the same absolute paths, and the same as write_manifest said.
    assert m == read_manifest(profile, "train")
    assert m["outputs"]["drafter"] == drafter and m["outputs"]["command"] == command
    for key in ("cache", "corpus", "hub_id"):
        assert m["outputs"]["verifier"][key] == named[key], key
    assert m["config"]["run"]["output_dir"] == str(tmp_path / "a")

    # A run folder moved elsewhere reads its own paths.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = load_profile("configs/tiny.yaml", [f"run.output_dir={tmp_path / 'b'}"])
    assert read_manifest(moved, "train")["outputs"]["drafter"] == str(
        moved.run.run_dir / "train/checkpoints/3"
    )


def test_a_local_verifier_and_prompt_set_outside_every_base_are_not_published(tmp_path):
    model, data = tmp_path / "models" / "Qwen3-8B", tmp_path / "datasets" / "blend.jsonl"
    profile = load_profile(
        "configs/kimi-k2.5.yaml",
        [f"run.output_dir={tmp_path / 'runs'}", f"verifier.model={model}", f"data.dataset={data}"],
    )
    named = {"model": str(model), "where": f"{data} line 7", "dataset": str(data)}
    m = write_paths_manifest(profile, str(model / "drafter"), [], **named)
    text = (profile.run.run_dir / "train/manifest.json").read_text()
    assert str(tmp_path) not in text
    on_disk = json.loads(text)
    assert on_disk["outputs"]["verifier"]["where"] == "blend.jsonl line 7"
    assert on_disk["relative_paths"]["/outputs/verifier/where"] == "data"
    assert on_disk["config"]["verifier"]["model"] == "."
    assert m["outputs"]["verifier"] == named  # read back absolute on this machine
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = {"speculators_config": {"verifier": {"name_or_path": str(model)}}}
    (checkpoint / "config.json").write_text(json.dumps(config))
    portable_drafter(profile, checkpoint)
    assert str(tmp_path) not in (checkpoint / "config.json").read_text()


def test_a_drafter_names_its_verifier_without_a_machine_path(tmp_path):
    profile = load_profile("configs/tiny.yaml", [f"run.output_dir={tmp_path}"])
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = {"speculators_config": {"verifier": {"name_or_path": "", "architectures": []}}}
    for recorded, published in [
        (str(profile.run.run_dir / "verifier/model"), "verifier/model"),
        ("moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.5"),
        (str(Path.home() / "models/kimi"), "~/models/kimi"),
    ]:
        config["speculators_config"]["verifier"]["name_or_path"] = recorded
        (checkpoint / "config.json").write_text(json.dumps(config))
        portable_drafter(profile, checkpoint)
        saved = json.loads((checkpoint / "config.json").read_text())
        assert saved["speculators_config"]["verifier"] == {
            "name_or_path": published,
            "architectures": [],
        }


@pytest.mark.parametrize(
    ("config", "overrides", "serve", "says"),
    [
        ("tiny.yaml", [], "verifier/model", "built locally"),
        ("kimi-k2.5.yaml", [], "moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.5"),
        ("kimi-k2.5.yaml", ["verifier.model=/models/Kimi-K2.5"], "<path to Kimi-K2.5>", "local"),
    ],
)
def test_the_card_serves_a_verifier_a_reader_can_get(tmp_path, config, overrides, serve, says):
    from model_card.card import verifier_view

    profile = load_profile(REPO / "configs" / config, [f"run.output_dir={tmp_path}", *overrides])
    model = str(profile.run.run_dir / "verifier/model") if profile.verifier.build else "x"
    view = verifier_view(profile, {"model": model, "capture_layer_ids": [1]})
    assert view["serve"] == serve and says in view["name"]
    assert str(tmp_path) not in json.dumps(view)


def test_torn_last_record_is_dropped_on_resume(tmp_path):
    path = tmp_path / "responses.jsonl"
    writer = ResponseWriter(path)
    for id_ in ("a", "b"):
        writer.write({"id": id_, "source": "s", "conversations": [], "skip_reason": None})
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

    from pipeline.serving.hidden_states_connector import STOCK_ATTRIBUTES

    source = inspect.getsource(m.ExampleHiddenStatesConnector)
    missing = [
        a for a in STOCK_ATTRIBUTES if f"self.{a}" not in source and f"def {a}" not in source
    ]
    assert not missing, f"vLLM's stock connector no longer has {missing}"


def test_speculators_cpu_adapter_targets_exist():
    from pipeline.training.speculators_train import check_patch_targets

    check_patch_targets()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/no/such/verifier/folder", "no such folder"),
        ("no-such-org/no-such-verifier", "could not download the verifier .* Rerun once the Hub"),
    ],
)
def test_missing_verifier_names_the_model_and_the_fix(tmp_path, model, message):
    from pipeline import verifier

    profile = load_profile(
        REPO / "configs" / "kimi-k2.5.yaml",
        [f"run.output_dir={tmp_path}", f"verifier.model={model}"],
    )
    with pytest.raises(verifier.VerifierError, match=message) as info:
        verifier.run(profile)
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


def test_only_generate_cuts_a_torn_record_other_readers_refuse_it(tmp_path):
    from pipeline.core.responses import ResponsesError, read_responses

    path = tmp_path / "responses.jsonl"
    path.write_bytes(b'{"id": "a", "source": "s", "conversations": []}\n{"id": "b", "conv')
    with pytest.raises(ResponsesError, match=r"ends in a torn record.*rerun `make generate`"):
        list(read_responses(path))
    assert path.read_bytes().endswith(b'"conv')  # a reader leaves generate's file as it is
    assert finished_ids(path) == {"a"}  # generate, which owns it, cuts the torn record off
