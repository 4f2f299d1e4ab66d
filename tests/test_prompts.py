"""The prompt loader on the shipped data and on malformed rows, through `datasets`."""

import json
from pathlib import Path

import pytest

from pipeline.prompts import PromptDataError, data_revision, load_prompts

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_shipped_training_prompts_load_in_open_perfectblend_schema():
    rows = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", None)
    assert len(rows) == 320
    sources = {r.source for r in rows}
    assert len(sources) == 8 and all(s.startswith("tiny-blend/") for s in sources)
    assert any(r.messages[0]["role"] == "system" for r in rows)
    assert any(sum(m["role"] == "user" for m in r.messages) == 2 for r in rows)


def test_eval_prompts_are_held_out_and_cover_the_mt_bench_categories():
    train = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", None)
    held_out = load_prompts("data/eval/mt-categories.jsonl", None, "train", None)
    categories = {r.source.split("/")[1] for r in held_out}
    assert categories == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    }  # fmt: skip
    train_prompts = {m["content"] for r in train for m in r.messages if m["role"] == "user"}
    assert not any(r.first_exchange_prompt()[-1]["content"] in train_prompts for r in held_out)


def test_max_samples_and_revision_record(tmp_path):
    rows = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", 5)
    assert [r.id for r in rows] == ["tb-0001", "tb-0002", "tb-0003", "tb-0004", "tb-0005"]
    rev = data_revision("data/prompts/tiny-blend.jsonl", None)
    assert len(rev["sha256"]) == 64


def test_hub_dataset_must_be_pinned():
    with pytest.raises(PromptDataError, match="must be pinned"):
        load_prompts("someone/some-dataset", None, "train", None)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"conversations": [], "source": "s"}, "non-empty list"),
        ({"conversations": [{"from": "robot", "value": "hi"}], "source": "s"}, "unknown role"),
        ({"conversations": [{"from": "human", "value": "  "}], "source": "s"}, "empty or non-str"),
        ({"conversations": [{"from": "gpt", "value": "hello"}], "source": "s"}, "no human turn"),
        ({"conversations": [{"from": "human", "value": "hi"}], "source": ""}, "'source'"),
    ],
)
def test_malformed_rows_are_named(tmp_path, row, message):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "hi"}], "source": "s"}
    path = write_jsonl(tmp_path / "p.jsonl", [good, {"id": "bad", **row}])
    with pytest.raises(PromptDataError, match=message) as err:
        load_prompts(path, None, "train", None)
    assert "row 1 (id bad)" in str(err.value)


def test_duplicate_ids_are_an_error(tmp_path):
    row = {"id": "x", "conversations": [{"from": "human", "value": "hi"}], "source": "s"}
    path = write_jsonl(tmp_path / "p.jsonl", [row, row])
    with pytest.raises(PromptDataError, match="duplicate prompt id 'x'"):
        load_prompts(path, None, "train", None)


def test_rows_without_id_get_a_stable_content_id(tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}], "source": "s"}
    a = load_prompts(write_jsonl(tmp_path / "a.jsonl", [row]), None, "train", None)
    b = load_prompts(write_jsonl(tmp_path / "b.jsonl", [row]), None, "train", None)
    assert a[0].id == b[0].id and a[0].id.startswith("sha-")
