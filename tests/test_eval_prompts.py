"""Evaluation prompts: the shipped set, Spec-Bench / MT-bench question files, held-out checks,
and the prompts too long for the server's context, counted with a real tokenizer and template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.prompts import (
    EvalPromptError,
    check_held_out,
    fit_to_context,
    load_eval_prompts,
    prompt_token_counts,
    read_question_file,
)
from pipeline.core.config import ConfigError, load_profile

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


def test_spec_bench_question_files_send_every_turn():
    prompts = load_eval_prompts(load_profile(TINY, [f"eval.question_file={QUESTIONS}"]))
    assert [p.id for p in prompts] == ["81", "101", "111", "201"]
    first = {"role": "user", "content": "Compose a short travel note about a rainy harbour town."}
    assert prompts[0].messages == (first,)
    assert prompts[0].followups == ("Rewrite it as a limerick.",)
    # The second turn goes after the verifier's own reply to the first.
    assert prompts[0].conversation(["Rain again."]) == [
        first,
        {"role": "assistant", "content": "Rain again."},
        {"role": "user", "content": "Rewrite it as a limerick."},
    ]
    assert prompts[1].followups == () and prompts[3].category == "translation"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"question_id": 1, "category": "math", "turns": []}', "'turns' must be a list"),
        ('{"question_id": 1, "category": "math", "turns": ["q", ""]}', "non-empty questions"),
        ('{"question_id": 1, "turns": ["q"]}', "needs 'question_id' and a 'category'"),
    ],
)
def test_a_malformed_question_line_is_named(tmp_path, line, message):
    path = tmp_path / "question.jsonl"
    path.write_text(QUESTIONS.read_text() + line + "\n")
    with pytest.raises(EvalPromptError, match=message) as info:
        read_question_file(path)
    assert f"{path}:5" in str(info.value)


def record(id_: str, conversations: list[dict]) -> str:
    """One line of generate's responses.jsonl."""
    return json.dumps({"id": id_, "source": "s", "conversations": conversations}) + "\n"


def test_training_prompts_are_refused_as_evaluation_prompts(tmp_path):
    prompts = load_eval_prompts(load_profile(TINY, [f"eval.question_file={QUESTIONS}"]))
    responses = tmp_path / "responses.jsonl"
    leaked = {"from": "human", "value": "What is 17 times 3?"}
    responses.write_text(record("r1", [leaked, {"from": "gpt", "value": "51"}]))
    with pytest.raises(EvalPromptError, match="1 evaluation prompts are also training prompts"):
        check_held_out(prompts, responses)
    second_turn = {"from": "human", "value": "Rewrite it as a limerick."}  # question 81's
    responses.write_text(record("r1", [second_turn, {"from": "gpt", "value": "..."}]))
    with pytest.raises(EvalPromptError, match=r"ids \['81'\]"):
        check_held_out(prompts, responses)
    responses.write_text(record("r1", [{"from": "human", "value": "other"}]))
    check_held_out(prompts, responses)


def test_the_shipped_eval_set_is_held_out_from_the_shipped_training_set(tmp_path):
    lines = Path("data/prompts/tiny-blend.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(record(r["id"], r["conversations"]) for r in rows))
    check_held_out(load_eval_prompts(load_profile(TINY)), responses)


def test_eval_sweeps_are_validated():
    with pytest.raises(ConfigError, match="lists a value twice"):
        load_profile(TINY, ["eval.num_speculative_tokens=[2, 2]"])
    with pytest.raises(ConfigError, match="must include 1"):
        load_profile(TINY, ["eval.concurrency=[4, 8]"])
    with pytest.raises(ConfigError, match="methods"):
        load_profile(TINY, ["eval.methods=[medusa]"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny verifier's tokenizer and chat template, trained as `make verifier` does (~2 s);
    its template reads ``thinking``, to show chat_template_kwargs reach the count."""
    from pipeline.verifier.chat_format import train_tokenizer

    spec = load_profile(TINY).verifier.build
    lines = Path(spec.corpus).read_text().splitlines()
    texts = [t["value"] for line in lines for t in json.loads(line)["conversations"]]
    tokenizer = train_tokenizer(texts, spec.vocab_size, spec.max_position_embeddings)
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return out


def long_questions(tmp_path: Path) -> Path:
    """Spec-Bench's shape: short questions, and long rag and summarization ones."""
    sentence = "The harbour town keeps its boats in a sheltered bay. "
    rows = [
        *map(json.loads, QUESTIONS.read_text().splitlines()),
        {"question_id": 301, "category": "rag", "turns": [sentence * 20 + "Where are the boats?"]},
        {"question_id": 401, "category": "summarization", "turns": ["Summarise: " + sentence * 40]},
        {"question_id": 402, "category": "summarization", "turns": ["In short: " + sentence * 80]},
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def context(max_model_len: int, max_tokens: int):
    return load_profile(TINY, [f"server.max_model_len={max_model_len}", "extract.max_seq_len=64",
                               f"eval.max_tokens={max_tokens}"])  # fmt: skip


def test_prompts_longer_than_the_context_are_skipped_and_named(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    questions = long_questions(tmp_path)
    profile = load_profile(TINY, [f"eval.question_file={questions}", "eval.max_tokens=96"])
    prompts = load_eval_prompts(profile)
    counts = prompt_token_counts(prompts, str(tokenizer_dir), profile)
    # The count is the template's render with a generation prompt, as vLLM's chat endpoint
    # tokenises it (checked against vLLM's own usage.prompt_tokens in the e2e tests).
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # A question of two turns counts its second request, the first reply taken at
    # eval.max_tokens: a bound on what it sends.
    for p in prompts:
        replies = [""] * len(p.followups)
        text = tokenizer.apply_chat_template(p.conversation(replies), add_generation_prompt=True,
                                             tokenize=False,
                                             **profile.generate.chat_template_kwargs)  # fmt: skip
        assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
        assert counts[p.id] == 96 * len(replies) + len(
            tokenizer(text, add_special_tokens=False, verbose=False).input_ids
        )
    assert [p.id for p in prompts if p.followups] == ["81"]
    assert "Rewrite it as a limerick." in tokenizer.decode(
        tokenizer.apply_chat_template(prompts[0].conversation([""]), tokenize=True)
    )
    assert counts["301"] < counts["401"] < counts["402"]
    # A prompt exactly at max_model_len - max_tokens fits; one token more does not.
    at_limit = context(counts["301"] + 96, max_tokens=96)
    kept, skipped = fit_to_context(prompts, counts, at_limit)
    assert [p.id for p in kept] == ["81", "101", "111", "201", "301"]
    assert skipped == {
        "reason": "prompt_too_long",
        "max_prompt_tokens": counts["301"],
        "count": 2,
        "per_category": {"summarization": 2},
        "prompts": [
            {"id": "401", "category": "summarization", "prompt_tokens": counts["401"]},
            {"id": "402", "category": "summarization", "prompt_tokens": counts["402"]},
        ],
    }
    one_less = context(counts["301"] + 95, max_tokens=96)
    _, skipped = fit_to_context(prompts, counts, one_less)
    assert skipped["per_category"] == {"rag": 1, "summarization": 2}


def test_no_prompt_that_fits_is_an_error_naming_the_fix(tmp_path, tokenizer_dir):
    profile = context(64, max_tokens=48)
    prompts = load_eval_prompts(profile)
    counts = prompt_token_counts(prompts, str(tokenizer_dir), profile)
    with pytest.raises(EvalPromptError, match="none of the 64 evaluation prompts fits") as info:
        fit_to_context(prompts, counts, profile)
    assert "at most 16 prompt tokens" in str(info.value)
    assert "raise server.max_model_len, lower eval.max_tokens" in str(info.value)


def test_the_count_renders_the_template_with_chat_template_kwargs(tokenizer_dir):
    def profile(thinking: str):
        return load_profile(
            TINY,
            [f"eval.question_file={QUESTIONS}", f"generate.chat_template_kwargs={{{thinking}}}"],
        )

    plain, thinking = profile("thinking: false"), profile("thinking: true")
    prompts = load_eval_prompts(plain)
    without = prompt_token_counts(prompts, str(tokenizer_dir), plain)
    with_ = prompt_token_counts(prompts, str(tokenizer_dir), thinking)
    # Kimi's template: thinking ends the prompt with <think>, not thinking with <think></think>
    assert {pid: without[pid] - n for pid, n in with_.items()} == dict.fromkeys(without, 1)


def test_a_missing_tokenizer_is_named(tmp_path):
    profile = load_profile(TINY, [f"eval.question_file={QUESTIONS}"])
    with pytest.raises(EvalPromptError, match="cannot load the verifier's tokenizer from"):
        prompt_token_counts(load_eval_prompts(profile), str(tmp_path / "nothing"), profile)
