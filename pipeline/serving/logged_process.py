"""Run a tool as a subprocess with its output in a log file; on failure, quote the log's tail.

Stages call external tools (speculators' CLIs, the trainer) this way so that a long run keeps
the whole output on disk while an error message stays short and points at the file.

The tool runs under :mod:`pipeline.serving.server_guard` in a process group of its own, like a vLLM
server: it dies with the stage however the stage ends (a SIGKILLed stage must not leave a
trainer holding the GPUs), and an exception here (Ctrl-C) stops the group before it propagates.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.serving.server_guard import start_guarded, stop_guarded

log = logging.getLogger(__name__)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def run_logged(
    cmd: list[str],
    log_path: Path,
    error: type[PipelineError],
    what: str,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``cmd`` appending its output to ``log_path``; raise ``error`` if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: %s (log %s)", what, " ".join(cmd), log_path)
    with open(log_path, "ab") as fh:
        proc, start = start_guarded(cmd, fh, env)
    try:
        code = proc.wait()
    finally:
        stop_guarded(proc, start)  # interrupted here: the tool and its workers; else leftovers
    if code:
        raise error(f"{what} failed with status {code}; log {log_path}:\n{log_tail(log_path)}")
