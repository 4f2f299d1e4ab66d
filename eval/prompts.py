"""The prompts `make eval` measures, each with its category, held out from training.

Two sources, one shape:
- ``data.eval_dataset``: rows in the training schema (open-perfectblend's), whose ``source`` ends
  in the category, e.g. ``mt-categories/writing`` (the shipped set covers the 8 MT-bench ones);
- ``eval.question_file``: Spec-Bench's or MT-bench's ``question.jsonl``, one
  ``{"question_id", "category", "turns": [...]}`` object per line.

From ``data.eval_dataset`` the conversation up to its first user turn is sent. A question
file's every turn is sent, as Spec-Bench does: each later turn (``EvalPrompt.followups``) after
the verifier's own reply to the one before, within each arm. A prompt any of whose user turns
is also a training prompt is an error: acceptance measured on training data overstates what users
will see.

A prompt that cannot fit the server's context with room for the reply (its tokens, counted with
the verifier's own tokenizer and chat template as vLLM renders them, above
``server.max_model_len - eval.max_tokens``; for several turns, the whole conversation with every
earlier reply counted at ``eval.max_tokens``) is skipped before any server starts, and recorded
with its id, category and token count (:func:`fit_to_context`): vLLM would cut its reply short
of ``eval.max_tokens`` (measured unlike the others), or refuse it with a 400 once the prompt
alone fills ``max_model_len``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile
from pipeline.core.errors import PipelineError
from pipeline.core.prompts import data_revision, load_prompts, resolve_local
from pipeline.core.responses import read_responses


class EvalPromptError(PipelineError):
    """The evaluation prompts cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    category: str
    messages: tuple[dict[str, str], ...]
    # User turns sent after the verifier's reply to the one before (a question file's second).
    followups: tuple[str, ...] = ()

    def conversation(self, replies: list[str]) -> list[dict[str, str]]:
        """The messages of the next request, after the verifier's ``replies`` so far."""
        messages = list(self.messages)
        for reply, text in zip(replies, self.followups, strict=False):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": text}]
        return messages

    @property
    def first_user_text(self) -> str:
        return next(m["content"] for m in self.messages if m["role"] == "user")


def read_question_file(path: Path) -> list[EvalPrompt]:
    """Spec-Bench / MT-bench ``question.jsonl``; a malformed line is named, not skipped."""
    if not path.is_file():
        raise EvalPromptError(f"eval.question_file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            q = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalPromptError(f"{where}: not JSON ({err.msg})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise EvalPromptError(f"{where}: 'turns' must be a list of non-empty questions")
        if "question_id" not in q or not isinstance(q.get("category"), str):
            raise EvalPromptError(f"{where}: needs 'question_id' and a 'category' string")
        prompts.append(
            EvalPrompt(
                id=str(q["question_id"]),
                category=q["category"],
                messages=({"role": "user", "content": turns[0]},),
                followups=tuple(turns[1:]),
            )
        )
    if not prompts:
        raise EvalPromptError(f"eval.question_file {path} holds no question")
    return prompts


def load_eval_prompts(profile: Profile) -> list[EvalPrompt]:
    """The evaluation prompts; ``data.eval_max_samples`` keeps every category represented."""
    d, e = profile.data, profile.eval
    if e.question_file is not None:
        prompts = read_question_file(resolve_local(str(e.question_file)) or e.question_file)
    else:
        rows = load_prompts(d.eval_dataset, d.eval_revision, d.eval_split, None)
        prompts = [
            EvalPrompt(r.id, category_of(r.source), tuple(r.first_exchange_prompt())) for r in rows
        ]
    return round_robin(prompts, d.eval_max_samples) if d.eval_max_samples else prompts


def round_robin(prompts: list[EvalPrompt], n: int) -> list[EvalPrompt]:
    """The first ``n`` prompts taking one from each category in turn, in file order."""
    queues = [list(group) for group in by_category(prompts).values()]
    picked: list[EvalPrompt] = []
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def category_of(source: str) -> str:
    """``mt-categories/writing`` -> ``writing``."""
    return source.rsplit("/", 1)[-1]


def eval_data_revision(profile: Profile) -> dict[str, Any]:
    if profile.eval.question_file is not None:
        return data_revision(str(profile.eval.question_file), None)
    return data_revision(profile.data.eval_dataset, profile.data.eval_revision)


def by_category(prompts: list[EvalPrompt]) -> dict[str, list[EvalPrompt]]:
    groups: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    return groups


def check_held_out(prompts: list[EvalPrompt], responses: Path) -> None:
    """Refuse prompts any of whose user turns is also a training prompt's (``generate``
    output)."""
    trained = {
        text.strip() for record in read_responses(responses) for text in record.turns("human")
    }
    leaked = [
        p.id
        for p in prompts
        if any(text.strip() in trained for text in (p.first_user_text, *p.followups))
    ]
    if leaked:
        raise EvalPromptError(
            f"{len(leaked)} evaluation prompts are also training prompts (ids {leaked[:5]}...): "
            "acceptance on them overstates what users will see; remove them from the "
            "evaluation set or from the training data"
        )


def prompt_token_counts(
    prompts: list[EvalPrompt], tokenizer_name: str, profile: Profile
) -> dict[str, int]:
    """Each prompt's tokens as vLLM's chat endpoint counts them: the chat template rendered
    with a generation prompt (and ``generate.chat_template_kwargs``, which eval sends too),
    then tokenised without special tokens of its own. A conversation of several turns counts
    its last request, every earlier reply taken at ``eval.max_tokens``: a bound on what it
    sends."""
    from transformers import AutoTokenizer

    v = profile.verifier
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_name, revision=v.revision, trust_remote_code=v.trust_remote_code
        )
    except OSError as err:
        raise EvalPromptError(
            f"cannot load the verifier's tokenizer from {tokenizer_name} to count prompt tokens "
            f"({' '.join(str(err).split())[:200]}); rerun `make verifier`, or cache the model"
        ) from None
    counts = {}
    for p in prompts:
        replies = [""] * len(p.followups)
        text = tokenizer.apply_chat_template(
            p.conversation(replies),
            tokenize=False,
            add_generation_prompt=True,
            **profile.generate.chat_template_kwargs,
        )
        rendered = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        counts[p.id] = rendered + len(replies) * profile.eval.max_tokens
    return counts


def fit_to_context(
    prompts: list[EvalPrompt], counts: dict[str, int], profile: Profile
) -> tuple[list[EvalPrompt], dict[str, Any]]:
    """The prompts that fit ``server.max_model_len`` with ``eval.max_tokens`` to spare, and the
    record of the others: their ids, categories and token counts, counted per category."""
    max_model_len, max_tokens = profile.server.max_model_len, profile.eval.max_tokens
    limit = max_model_len - max_tokens
    kept = [p for p in prompts if counts[p.id] <= limit]
    over = [p for p in prompts if counts[p.id] > limit]
    per_category: dict[str, int] = {}
    for p in over:
        per_category[p.category] = per_category.get(p.category, 0) + 1
    record = {
        "reason": "prompt_too_long",
        "max_prompt_tokens": limit,
        "count": len(over),
        "per_category": per_category,
        "prompts": [
            {"id": p.id, "category": p.category, "prompt_tokens": counts[p.id]} for p in over
        ],
    }
    if not kept:
        raise EvalPromptError(
            f"none of the {len(prompts)} evaluation prompts fits server.max_model_len="
            f"{max_model_len} with eval.max_tokens={max_tokens} to spare (at most {limit} "
            f"prompt tokens; the shortest has {min(counts[p.id] for p in prompts)}): raise "
            "server.max_model_len, lower eval.max_tokens, or use shorter prompts"
        )
    return kept, record
