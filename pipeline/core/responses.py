"""The one reader of generate's ``responses.jsonl``: one record per prompt id, each line whole.

Every stage that reads the regenerated conversations (generate itself on a rerun, extract, the
license check, eval's leak guard) reads them here, so they agree on what a record is. A record
is open-perfectblend's schema plus what generate adds: ``id``, ``source``, ``conversations``
(turns ``{"from": "human"|"gpt"|"system", "value": ...}``, empty for a skipped prompt),
``skip_reason`` (None when kept) and ``usage``.

Invariant: a torn last line (a crash mid-write) is cut off, with a warning, by generate, which
owns the file; any other reader, and any line that is not a record, stops with the file and the
record's number.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)


class ResponsesError(PipelineError):
    """``responses.jsonl`` holds a line that is not a generate record."""


class ResponseRecord(BaseModel):
    """One regenerated conversation (or a skipped prompt, with its reason)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    id: str
    source: str
    conversations: list[dict[str, Any]]
    skip_reason: str | None = None
    usage: dict[str, Any] | None = None

    def turns(self, speaker: str) -> list[str]:
        """The text of each turn of ``speaker`` ("human", "gpt", "system")."""
        return [t["value"] for t in self.conversations if t.get("from") == speaker]


def complete_records(path: Path, *, repair: bool = False) -> list[bytes]:
    """The file's record lines. A torn (partial) last line from a crash is cut off first when
    ``repair`` (generate, which owns the file and regenerates that record), else an error."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        if not repair:
            raise ResponsesError(
                f"{path} ends in a torn record (a crash while writing it); rerun "
                "`make generate`, which cuts it off and regenerates it"
            )
        cut = data.rfind(b"\n") + 1
        log.warning("dropping a torn last record in %s (%d bytes)", path, len(data) - cut)
        with open(path, "r+b") as fh:
            fh.truncate(cut)
            os.fsync(fh.fileno())
        data = data[:cut]
    return [line for line in data.splitlines() if line.strip()]


def read_responses(path: Path, *, repair: bool = False) -> Iterator[ResponseRecord]:
    """Each record of ``path`` in file order; a malformed line is an error naming it (a torn
    last line too, unless ``repair``: see :func:`complete_records`)."""
    for number, line in enumerate(complete_records(path, repair=repair), 1):
        try:
            yield ResponseRecord.model_validate(json.loads(line))
        except (ValueError, ValidationError) as err:
            detail = " ".join(str(err).split())[:200]
            raise ResponsesError(
                f"{path}: record {number} is not a generate record ({detail}); rerun "
                "`make generate` (finished records are kept)"
            ) from None
