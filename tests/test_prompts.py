"""The prompt loader on the shipped data and on malformed rows, through `datasets`."""

import collections
import json
from pathlib import Path

import pytest

from pipeline.core.prompts import PromptDataError, data_revision, load_prompt_set, load_prompts

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


def test_max_samples_is_a_seeded_sample_stratified_by_source():
    rows = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", 16)
    assert len(rows) == 16
    by_source = collections.Counter(r.source for r in rows)
    assert len(by_source) == 8 and set(by_source.values()) == {2}  # 40 rows of each of 8
    again = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", 16)
    other = load_prompts("data/prompts/tiny-blend.jsonl", None, "train", 16, seed=1)
    assert [r.id for r in again] == [r.id for r in rows] != [r.id for r in other]
    assert [r.id for r in rows] == sorted(r.id for r in rows)  # file order kept
    rev = data_revision("data/prompts/tiny-blend.jsonl", None)
    assert len(rev["sha256"]) == 64


def test_a_prompt_file_ordered_by_source_is_sampled_in_proportion(tmp_path):
    shares = {"big": 600, "mid": 300, "small": 97, "tiny": 3}
    rows = [
        {"id": f"{src}-{i}", "conversations": [{"from": "human", "value": f"q {src} {i}"}],
         "source": src}
        for src, n in shares.items() for i in range(n)
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "ordered.jsonl", rows)
    sample = load_prompt_set(path, None, "train", 100, seed=7)
    counts = collections.Counter(r.source for r in sample.rows)
    assert counts == {"big": 60, "mid": 30, "small": 10}  # "tiny"'s 0.3 loses to the remainders
    assert sample.sampling.method == "stratified" and sample.sampling.seed == 7
    assert sample.sampling.by_source["small"] == {"available": 97, "sampled": 10}
    assert sample.sampling.by_source["tiny"] == {"available": 3, "sampled": 0}
    larger = load_prompt_set(path, None, "train", 300, seed=7)
    assert {r.id for r in sample.rows} < {r.id for r in larger.rows}  # a pilot is reused
    whole = load_prompt_set(path, None, "train", None)
    assert whole.sampling.method == "all" and len(whole.rows) == 1000


def test_hub_dataset_must_be_pinned():
    with pytest.raises(PromptDataError, match="must be pinned"):
        load_prompts("someone/some-dataset", None, "train", None)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"conversations": [], "source": "s"}, "non-empty list"),
        ({"conversations": [{"from": "robot", "value": "hi"}], "source": "s"}, "unknown role"),
        ({"conversations": [{"from": ["human"], "value": "hi"}], "source": "s"}, "unknown role"),
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
    assert f"{path} line 2 (id bad)" in str(err.value)


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


def broken_file(tmp_path: Path) -> str:
    good = [
        json.dumps({"id": f"ok-{i}", "conversations": [{"from": "human", "value": f"hi {i}"}],
                    "source": "s"}).encode()
        for i in range(4)
    ]  # fmt: skip
    lines = [
        good[0],
        b'{"id": "torn", "conversations": [{"from": "human", "value": "cut in the mid',
        good[1],
        b"",
        b'{"id": "latin1", "source": "s", "conversations": [{"from": "human", "value": "\xe9"}]}',
        good[2],
        b"[1, 2]",
        good[3],
    ]
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_a_broken_line_stops_with_its_file_and_line_number(tmp_path):
    path = broken_file(tmp_path)
    with pytest.raises(PromptDataError) as err:
        load_prompts(path, None, "train", None)
    message = str(err.value)
    assert message.startswith(f"{path} line 2: not JSON")
    assert "data.on_malformed_row=skip" in message and "\n" not in message


def test_broken_lines_are_skipped_with_reason_and_line_number(tmp_path):
    path = broken_file(tmp_path)
    loaded = load_prompt_set(path, None, "train", None, on_malformed="skip")
    assert [r.id for r in loaded.rows] == ["ok-0", "ok-1", "ok-2", "ok-3"]
    assert sorted((r.where, r.reason) for r in loaded.rejected) == [
        (f"{path} line 2", "invalid_json"),
        (f"{path} line 4", "empty_line"),
        (f"{path} line 5", "invalid_utf8"),
        (f"{path} line 7", "malformed_row"),
    ]
    assert [r.where for r in loaded.rows] == [f"{path} line {n}" for n in (1, 3, 6, 8)]


def test_empty_lines_count_when_every_row_is_read_not_against_a_sample(tmp_path):
    path = broken_file(tmp_path)
    whole = load_prompt_set(path, None, "train", None, on_malformed="skip")
    sample = load_prompt_set(path, None, "train", 2, on_malformed="skip")
    assert "empty_line" in {r.reason for r in whole.rejected}
    assert "empty_line" not in {r.reason for r in sample.rejected}
    drawn = sum(c["sampled"] for c in sample.sampling.by_source.values())
    assert len(sample.rows) + len(sample.rejected) == drawn == 2
