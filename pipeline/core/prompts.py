"""Load prompt sets in open-perfectblend's schema, local or from the Hub, and sample them.

A row is ``{"id"?: str, "conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...],
"source": str}``; an answer (``gpt``) turn may carry its reasoning as ``"thinking": str``, read as
the message's ``reasoning_content``. A local JSONL file is read line by line here (so that one
broken line of a million is named by its 1-based line number, not a parser's traceback); parquet
files and Hub datasets go through ``datasets``, and a Hub id must be pinned by a revision so that
the data a drafter was trained on can be named exactly.

Invariants:
- every input line or row is accounted for: a :class:`PromptRow`, or a :class:`RejectedRow`
  with its place (``<file> line N``, 1-based; ``row N`` for a Hub or parquet dataset) and its
  reason (``invalid_utf8``, ``invalid_json``, ``malformed_row``, ``duplicate_id``,
  ``empty_line``; empty lines are counted only when no sample is drawn); with
  ``on_malformed="error"`` the first rejected row (empty lines aside) is one
  :class:`PromptDataError` naming the place and the fix;
- ``max_samples`` draws a seeded random sample, stratified by ``source`` in proportion to each
  source's share (largest remainders), so a prompt set ordered by source is not cut to its
  first sources; each source's rows are drawn in an order fixed by the seed, so a smaller
  sample is (but for rounding) part of a larger one; the rows keep their file order;
  :class:`Sampling` records seed and counts;
- a row without an ``id`` gets a stable one derived from its content, so that resume-by-id
  survives reordering.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets

from pipeline.core.errors import PipelineError
from pipeline.core.portable import REPO_ROOT

# open-perfectblend's `from` values (and their OpenAI spellings) -> OpenAI roles.
ROLE_OF = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
NO_SOURCE = "(no source)"  # the stratum of lines too broken to name their source
SKIP_HINT = "set data.on_malformed_row=skip to leave such rows out and count them"


class PromptDataError(PipelineError, ValueError):
    """A prompt set that cannot be loaded, or a row that breaks the schema."""


@dataclass(frozen=True)
class PromptRow:
    id: str
    source: str
    # OpenAI-style messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]
    messages: tuple[dict[str, str], ...]
    where: str = ""  # "<file> line N" or "row N": where the row came from

    def first_exchange_prompt(self) -> list[dict[str, str]]:
        """The conversation up to and including its first user turn."""
        upto = next(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return list(self.messages[: upto + 1])


RejectReason = Literal[
    "invalid_utf8", "invalid_json", "malformed_row", "duplicate_id", "empty_line"
]


@dataclass(frozen=True)
class RejectedRow:
    where: str
    reason: RejectReason
    detail: str
    id: str | None = None
    source: str | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sampling:
    """How the rows were chosen: all of them, or ``max_samples`` drawn with ``seed``."""

    method: Literal["all", "stratified", "random"]
    seed: int
    max_samples: int | None
    # source -> {"available": rows of that source in the set, "sampled": rows drawn}
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PromptSet:
    rows: list[PromptRow]
    rejected: list[RejectedRow]
    sampling: Sampling


@dataclass(frozen=True)
class _Candidate:
    """One input line or row before validation: its data, or why it has none."""

    where: str
    data: dict[str, Any] | None
    problem: RejectedRow | None = None

    @property
    def source(self) -> str:
        src = self.data.get("source") if self.data is not None else None
        return src if isinstance(src, str) and src else NO_SOURCE


def resolve_local(name: str) -> Path | None:
    """A dataset given as a path, absolute or relative to the repository, if it exists."""
    for candidate in (Path(name), REPO_ROOT / name):
        if candidate.exists():
            return candidate.resolve()
    return None


def local_files(dataset: str, local: Path) -> list[Path]:
    files = [local] if local.is_file() else sorted(local.glob("*.jsonl"))
    if not files:
        raise PromptDataError(f"{dataset}: no .jsonl files in this folder")
    if files[0].suffix not in LOCAL_FORMATS:
        raise PromptDataError(
            f"{files[0]}: unsupported file type; use one of {', '.join(LOCAL_FORMATS)}"
        )
    return files


def local_jsonl(dataset: str) -> tuple[Path, list[Path]] | None:
    """A local JSONL set: the file or folder given, and its files; None for anything else."""
    local = resolve_local(dataset)
    if local is None:
        return None
    files = local_files(dataset, local)
    return (local, files) if files[0].suffix == ".jsonl" else None


def parse_line(where: str, raw: bytes) -> _Candidate:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _Candidate(where, None, RejectedRow(where, "invalid_utf8", f"not UTF-8: {err}"))
    if not text.strip():
        return _Candidate(where, None, RejectedRow(where, "empty_line", "an empty line"))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return _Candidate(where, None, RejectedRow(where, "invalid_json", f"not JSON: {err}"))
    if not isinstance(data, dict):
        return _Candidate(
            where, None, RejectedRow(where, "malformed_row", "not a JSON object (one row a line)")
        )
    return _Candidate(where, data)


def jsonl_lines(
    dataset: str, files: list[Path], local: Path, wanted: set[tuple[int, int]] | None = None
) -> Iterator[tuple[tuple[int, int], str, bytes]]:
    """Each line (or each ``wanted`` one) of the files, streamed: ((file index, 1-based line
    number), its place ``<dataset>[/<file>] line N``, its bytes)."""
    for k, f in enumerate(files):
        name = dataset if f == local else f"{dataset.rstrip('/')}/{f.name}"
        with f.open("rb") as fh:
            for number, raw in enumerate(fh, 1):
                if wanted is None or (k, number) in wanted:
                    yield (k, number), f"{name} line {number}", raw.rstrip(b"\r\n")


def read_jsonl(
    dataset: str, files: list[Path], local: Path, max_samples: int | None, seed: int
) -> tuple[list[_Candidate], list[RejectedRow], Sampling]:
    """Two streamed passes, so that a multi-gigabyte local set is never held whole: the first
    notes each line's source (what sampling needs), the second parses the drawn lines."""
    keys: list[tuple[int, int]] = []
    sources: list[str] = []
    empty: list[RejectedRow] = []
    for key, where, raw in jsonl_lines(dataset, files, local):
        line = parse_line(where, raw)
        if line.problem is not None and line.problem.reason == "empty_line":
            empty.append(line.problem)
            continue
        keys.append(key)
        sources.append(sys.intern(line.source))
    picked, sampling = sample_indices(sources, max_samples, seed)
    drawn = {keys[i] for i in picked}
    parsed = [parse_line(where, raw) for _, where, raw in jsonl_lines(dataset, files, local, drawn)]
    # Empty lines are not rows: counted when every row is read, not against a sample.
    return parsed, empty if sampling.method == "all" else [], sampling


def load_table(dataset: str, revision: str | None, split: str) -> datasets.Dataset:
    """A parquet/JSON file or folder through ``datasets``, or a pinned Hub dataset."""
    local = resolve_local(dataset)
    if local is not None:
        files = local_files(dataset, local)
        return datasets.load_dataset(
            LOCAL_FORMATS[files[0].suffix], data_files=[str(f) for f in files], split="train"
        )
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


def count_rows(dataset: str, revision: str | None, split: str) -> int:
    """How many non-empty rows the set holds (what ``max_samples`` draws from)."""
    if (jsonl := local_jsonl(dataset)) is not None:
        local, files = jsonl
        lines = jsonl_lines(dataset, files, local)
        return sum(bool(raw.strip()) for _, _, raw in lines)
    return len(load_table(dataset, revision, split))


def allot(available: dict[str, int], n: int) -> dict[str, int]:
    """``n`` split over the strata in proportion to their sizes, by largest remainders."""
    total = sum(available.values())
    exact = {s: n * c / total for s, c in available.items()}
    quota = {s: int(q) for s, q in exact.items()}
    by_remainder = sorted(available, key=lambda s: (quota[s] - exact[s], s))
    for s in by_remainder[: n - sum(quota.values())]:
        quota[s] += 1
    return quota


def seeded_order(indices: list[int], seed: int, source: str) -> list[int]:
    """``indices`` in an order fixed by the seed and the source alone, not by the sample size:
    a smaller sample's rows are the first of a larger one's (a pilot's work is reused)."""
    order = list(indices)
    random.Random(f"{seed}:{source}").shuffle(order)
    return order


def sample_indices(
    sources: list[str] | None, n: int | None, seed: int
) -> tuple[list[int], Sampling]:
    """Indices to keep, ascending, and the record of how they were drawn."""
    size = len(sources) if sources is not None else 0
    strata: dict[str, list[int]] = {}
    for i, s in enumerate(sources or ()):
        strata.setdefault(s, []).append(i)
    available = {s: len(ix) for s, ix in sorted(strata.items())}
    if n is None or n >= size:
        return list(range(size)), Sampling(
            "all", seed, n, {s: {"available": c, "sampled": c} for s, c in available.items()}
        )
    quota = allot(available, n)
    picked = sorted(i for s in available for i in seeded_order(strata[s], seed, s)[: quota[s]])
    method = "stratified" if len(available) > 1 else "random"
    by_source = {s: {"available": c, "sampled": quota[s]} for s, c in available.items()}
    return picked, Sampling(method, seed, n, by_source)


def candidates(
    dataset: str, revision: str | None, split: str, max_samples: int | None, seed: int
) -> tuple[list[_Candidate], list[RejectedRow], Sampling]:
    """The sampled candidates, the empty lines (never candidates), and the sampling record."""
    if (jsonl := local_jsonl(dataset)) is not None:
        local, files = jsonl
        return read_jsonl(dataset, files, local, max_samples, seed)
    table = load_table(dataset, revision, split)
    if "source" in table.column_names:
        sources = [s if isinstance(s, str) and s else NO_SOURCE for s in table["source"]]
    else:
        sources = [NO_SOURCE] * len(table)
    picked, sampling = sample_indices(sources, max_samples, seed)
    rows = table.select(picked)
    return (
        [_Candidate(f"row {i + 1}", raw) for i, raw in zip(picked, rows, strict=True)],
        [],
        sampling,
    )


def content_id(conversations: list[dict[str, Any]]) -> str:
    blob = json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode()
    return "sha-" + hashlib.sha256(blob).hexdigest()[:16]


def normalise_row(where: str, row: dict[str, Any]) -> PromptRow:
    label = where + (f" (id {row['id']})" if row.get("id") else "")
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise PromptDataError(f"{label}: 'conversations' must be a non-empty list")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise PromptDataError(f"{label}: turn {t} is not a {{from, value}} object")
        said = turn.get("from")
        role = ROLE_OF.get(said) if isinstance(said, str) else None
        if role is None:
            raise PromptDataError(
                f"{label}: turn {t} has unknown role {turn.get('from')!r}; "
                f"allowed: {', '.join(sorted(ROLE_OF))}"
            )
        value = turn.get("value")
        if not isinstance(value, str) or not value.strip():
            raise PromptDataError(f"{label}: turn {t} has an empty or non-string 'value'")
        message = {"role": role, "content": value}
        thinking = turn.get("thinking")
        if role == "assistant" and thinking is not None:
            if not isinstance(thinking, str) or not thinking.strip():
                raise PromptDataError(f"{label}: turn {t} has an empty or non-string 'thinking'")
            message["reasoning_content"] = thinking
        messages.append(message)
    if not any(m["role"] == "user" for m in messages):
        raise PromptDataError(f"{label}: no human turn to answer")
    source = row.get("source")
    if not isinstance(source, str) or not source:
        raise PromptDataError(f"{label}: 'source' must name the upstream data source")
    row_id = row.get("id") or content_id(turns)
    return PromptRow(id=str(row_id), source=source, messages=tuple(messages), where=where)


def load_prompt_set(
    dataset: str,
    revision: str | None,
    split: str,
    max_samples: int | None,
    *,
    seed: int = 0,
    on_malformed: Literal["error", "skip"] = "error",
) -> PromptSet:
    """Load, sample, validate and normalise a prompt set; see the module's invariants."""
    drawn, rejected, sampling = candidates(dataset, revision, split, max_samples, seed)
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for c in drawn:
        problem = c.problem
        if problem is None:
            assert c.data is not None
            try:
                row = normalise_row(c.where, c.data)
            except PromptDataError as err:
                problem = RejectedRow(c.where, "malformed_row", str(err), source=c.source)
            else:
                if row.id not in seen:
                    seen.add(row.id)
                    rows.append(row)
                    continue
                problem = RejectedRow(
                    c.where, "duplicate_id", f"duplicate prompt id {row.id!r}", row.id, row.source
                )
        if on_malformed == "error":
            detail = (
                problem.detail
                if problem.detail.startswith(c.where)
                else (f"{c.where}: {problem.detail}")
            )
            raise PromptDataError(f"{detail}; fix the line, or {SKIP_HINT}")
        rejected.append(problem)
    return PromptSet(rows, rejected, sampling)


def load_prompts(
    dataset: str, revision: str | None, split: str, max_samples: int | None, *, seed: int = 0
) -> list[PromptRow]:
    """The rows of a prompt set that must be clean: a malformed row is an error."""
    return load_prompt_set(dataset, revision, split, max_samples, seed=seed).rows


def data_revision(dataset: str, revision: str | None) -> dict[str, Any]:
    """What names this exact data: the Hub revision, or the local files' sha256."""
    local = resolve_local(dataset)
    if local is None:
        return {"dataset": dataset, "revision": revision}
    files = [local] if local.is_file() else sorted(local.glob("*.jsonl"))
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            hashlib.file_digest(fh, lambda: digest)
    return {"dataset": dataset, "revision": None, "sha256": digest.hexdigest()}


# The source of prompts the verifier writes itself (pipeline.serving.self_written_prompts),
# licensed as the verifier is (release/license_rules.py).
SELF_WRITTEN_SOURCE = "self-written"


def request_seed(run_seed: int, row_id: str, turn: int) -> int:
    """The sampling seed of one reply: fixed by the run seed, the prompt and the turn, so a
    resumed or resharded run samples each reply as an uninterrupted one would."""
    digest = hashlib.sha256(f"{run_seed}:{row_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # a non-negative 31-bit integer
