"""The prompts `make eval` measures, each with its category, held out from training.

Two sources, one shape:
- ``data.eval_dataset``: rows in the training schema (open-perfectblend's), whose ``source`` ends
  in the category, e.g. ``mt-categories/writing`` (the shipped set covers the 8 MT-bench ones);
- ``eval.question_file``: Spec-Bench's or MT-bench's ``question.jsonl``, one
  ``{"question_id", "category", "turns": [...]}`` object per line.

Only the conversation up to its first user turn is sent, so runs are comparable across
sources. A prompt whose text is also a training prompt is an error: acceptance measured on
training data overstates what users will see.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Profile
from pipeline.errors import PipelineError
from pipeline.prompts import data_revision, load_prompts, resolve_local


class EvalPromptError(PipelineError):
    """The evaluation prompts cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    category: str
    messages: tuple[dict[str, str], ...]

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
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]):
            raise EvalPromptError(f"{where}: 'turns' must be a list starting with a question")
        if "question_id" not in q or not isinstance(q.get("category"), str):
            raise EvalPromptError(f"{where}: needs 'question_id' and a 'category' string")
        prompts.append(
            EvalPrompt(
                id=str(q["question_id"]),
                category=q["category"],
                messages=({"role": "user", "content": turns[0]},),
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
    """Refuse prompts whose first user turn is also a training prompt's (``generate`` output)."""
    trained = set()
    for line in responses.read_text().splitlines():
        turns = json.loads(line)["conversations"]
        trained.update(t["value"].strip() for t in turns if t["from"] == "human")
    leaked = [p.id for p in prompts if p.first_user_text.strip() in trained]
    if leaked:
        raise EvalPromptError(
            f"{len(leaked)} evaluation prompts are also training prompts (ids {leaked[:5]}...): "
            "acceptance on them overstates what users will see; remove them from the "
            "evaluation set or from the training data"
        )
