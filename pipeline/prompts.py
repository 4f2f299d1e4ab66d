"""Load prompt sets in open-perfectblend's schema through ``datasets``, local or from the Hub.

A row is ``{"id"?: str, "conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...],
"source": str}``. The same loader reads a shipped JSONL file and a Hub dataset id; a Hub id must
be pinned by a revision so that the data a drafter was trained on can be named exactly.

Rows are normalised to :class:`PromptRow` with OpenAI-style roles. A row without an ``id`` gets
a stable one derived from its content, so that resume-by-id survives reordering.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from pipeline.errors import PipelineError
from pipeline.manifest import REPO_ROOT

# open-perfectblend's `from` values (and their OpenAI spellings) -> OpenAI roles.
ROLE_OF = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class PromptDataError(PipelineError, ValueError):
    """A prompt set that cannot be loaded, or a row that breaks the schema."""


@dataclass(frozen=True)
class PromptRow:
    id: str
    source: str
    # OpenAI-style messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]
    messages: tuple[dict[str, str], ...]

    def first_exchange_prompt(self) -> list[dict[str, str]]:
        """The conversation up to and including its first user turn."""
        upto = next(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return list(self.messages[: upto + 1])


def resolve_local(name: str) -> Path | None:
    """A dataset given as a path, absolute or relative to the repository, if it exists."""
    for candidate in (Path(name), REPO_ROOT / name):
        if candidate.exists():
            return candidate.resolve()
    return None


def load_rows(dataset: str, revision: str | None, split: str) -> datasets.Dataset:
    local = resolve_local(dataset)
    if local is not None:
        files = [local] if local.is_file() else sorted(local.glob("*.jsonl"))
        if not files:
            raise PromptDataError(f"{local}: no .jsonl files in this folder")
        fmt = LOCAL_FORMATS.get(files[0].suffix)
        if fmt is None:
            raise PromptDataError(
                f"{files[0]}: unsupported file type; use one of {', '.join(LOCAL_FORMATS)}"
            )
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    if revision is None:
        raise PromptDataError(
            f"dataset {dataset!r} is not a local path, so it is read from the Hub and must be "
            "pinned: set data.revision (or data.eval_revision) to a commit SHA"
        )
    try:
        return datasets.load_dataset(dataset, revision=revision, split=split)
    except Exception as err:  # datasets raises many types for a missing/offline dataset
        raise PromptDataError(
            f"could not load dataset {dataset!r} at revision {revision}: {err}. "
            "Offline, point data.dataset at a local copy (file or folder)."
        ) from err


def content_id(conversations: list[dict[str, Any]]) -> str:
    blob = json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode()
    return "sha-" + hashlib.sha256(blob).hexdigest()[:16]


def normalise_row(index: int, row: dict[str, Any]) -> PromptRow:
    where = f"row {index}" + (f" (id {row['id']})" if row.get("id") else "")
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise PromptDataError(f"{where}: 'conversations' must be a non-empty list")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise PromptDataError(f"{where}: turn {t} is not a {{from, value}} object")
        role = ROLE_OF.get(turn.get("from"))
        if role is None:
            raise PromptDataError(
                f"{where}: turn {t} has unknown role {turn.get('from')!r}; "
                f"allowed: {', '.join(sorted(ROLE_OF))}"
            )
        value = turn.get("value")
        if not isinstance(value, str) or not value.strip():
            raise PromptDataError(f"{where}: turn {t} has an empty or non-string 'value'")
        messages.append({"role": role, "content": value})
    if not any(m["role"] == "user" for m in messages):
        raise PromptDataError(f"{where}: no human turn to answer")
    source = row.get("source")
    if not isinstance(source, str) or not source:
        raise PromptDataError(f"{where}: 'source' must name the upstream data source")
    row_id = row.get("id") or content_id(turns)
    return PromptRow(id=str(row_id), source=source, messages=tuple(messages))


def load_prompts(
    dataset: str,
    revision: str | None,
    split: str,
    max_samples: int | None,
    rejected: dict[str, str] | None = None,
) -> list[PromptRow]:
    """Load, validate and normalise a prompt set.

    A malformed row or a duplicate id is an error, unless ``rejected`` is given: then such rows
    are left out and recorded there (``"row <i>"`` -> reason), for the caller to count.
    """
    table = load_rows(dataset, revision, split)
    if max_samples is not None:
        table = table.select(range(min(max_samples, len(table))))
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for i, raw in enumerate(table):
        try:
            row = normalise_row(i, raw)
            if row.id in seen:
                raise PromptDataError(f"row {i}: duplicate prompt id {row.id!r} in {dataset}")
        except PromptDataError as err:
            if rejected is None:
                raise PromptDataError(
                    f"{err}; fix the row, or set data.on_malformed_row=skip to leave such rows "
                    "out and count them"
                ) from None
            rejected[f"row {i}"] = str(err)
            continue
        seen.add(row.id)
        rows.append(row)
    return rows


def data_revision(dataset: str, revision: str | None) -> dict[str, Any]:
    """What names this exact data: the Hub revision, or the local files' sha256."""
    local = resolve_local(dataset)
    if local is None:
        return {"dataset": dataset, "revision": revision}
    files = [local] if local.is_file() else sorted(local.glob("*.jsonl"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return {"dataset": dataset, "revision": None, "sha256": digest.hexdigest()}
