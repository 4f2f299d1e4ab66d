"""Evaluation prompts: the shipped set, Spec-Bench / MT-bench question files, held-out checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.eval_prompts import (
    EvalPromptError,
    check_held_out,
    load_eval_prompts,
    read_question_file,
)
from pipeline.config import ConfigError, load_profile

pytestmark = pytest.mark.unit
TINY = "configs/tiny.yaml"
QUESTIONS = Path(__file__).parent / "fixtures" / "spec_bench_questions.jsonl"
MT_BENCH = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def test_the_shipped_set_covers_the_eight_mt_bench_categories():
    prompts = load_eval_prompts(load_profile(TINY))
    counts = {c: sum(p.category == c for p in prompts) for c in MT_BENCH}
    assert len(prompts) == 64 and set(counts.values()) == {8}, counts
    assert all(p.messages[-1]["role"] == "user" for p in prompts)


def test_a_sample_keeps_every_category():
    prompts = load_eval_prompts(load_profile(TINY, ["data.eval_max_samples=16"]))
    assert len(prompts) == 16 and {p.category for p in prompts} == MT_BENCH


def test_spec_bench_question_files_send_the_first_turn():
    prompts = load_eval_prompts(load_profile(TINY, [f"eval.question_file={QUESTIONS}"]))
    assert [p.id for p in prompts] == ["81", "101", "111", "201"]
    assert prompts[0].messages == (
        {"role": "user", "content": "Compose a short travel note about a rainy harbour town."},
    )
    assert prompts[3].category == "translation"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"question_id": 1, "category": "math", "turns": []}', "'turns' must be a list"),
        ('{"question_id": 1, "turns": ["q"]}', "needs 'question_id' and a 'category'"),
    ],
)
def test_a_malformed_question_line_is_named(tmp_path, line, message):
    path = tmp_path / "question.jsonl"
    path.write_text(QUESTIONS.read_text() + line + "\n")
    with pytest.raises(EvalPromptError, match=message) as info:
        read_question_file(path)
    assert f"{path}:5" in str(info.value)


def test_training_prompts_are_refused_as_evaluation_prompts(tmp_path):
    prompts = load_eval_prompts(load_profile(TINY, [f"eval.question_file={QUESTIONS}"]))
    responses = tmp_path / "responses.jsonl"
    leaked = {"from": "human", "value": "What is 17 times 3?"}
    responses.write_text(json.dumps({"conversations": [leaked, {"from": "gpt", "value": "51"}]}))
    with pytest.raises(EvalPromptError, match="1 evaluation prompts are also training prompts"):
        check_held_out(prompts, responses)
    responses.write_text(json.dumps({"conversations": [{"from": "human", "value": "other"}]}))
    check_held_out(prompts, responses)


def test_the_shipped_eval_set_is_held_out_from_the_shipped_training_set(tmp_path):
    lines = Path("data/prompts/tiny-blend.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    responses = tmp_path / "responses.jsonl"
    responses.write_text("\n".join(json.dumps({"conversations": r["conversations"]}) for r in rows))
    check_held_out(load_eval_prompts(load_profile(TINY)), responses)


def test_eval_sweeps_are_validated():
    with pytest.raises(ConfigError, match="lists a value twice"):
        load_profile(TINY, ["eval.num_speculative_tokens=[2, 2]"])
    with pytest.raises(ConfigError, match="must include 1"):
        load_profile(TINY, ["eval.concurrency=[4, 8]"])
    with pytest.raises(ConfigError, match="methods"):
        load_profile(TINY, ["eval.methods=[medusa]"])
