"""Run a tool as a subprocess with its output in a log file; on failure, quote the log's tail.

Stages call external tools (speculators' CLIs, the trainer) this way so that a long run keeps
the whole output on disk while an error message stays short and points at the file.

The tool runs under :mod:`pipeline.serving.server_guard` in a process group of its own, like a vLLM
server: it dies with the stage however the stage ends (a SIGKILLed stage must not leave a
trainer holding the GPUs), and an exception here (Ctrl-C) stops the group before it propagates.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.serving.server_guard import start_guarded, stop_guarded

log = logging.getLogger(__name__)
POLL_S = 1.0


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_while_progressing(
    proc: subprocess.Popen, progress: Callable[[], int] | None, stall_s: float | None
) -> int | None:
    """``proc``'s exit status; None once ``progress()`` has stood still for ``stall_s``."""
    if progress is None or stall_s is None:
        return proc.wait()
    last, since = progress(), time.monotonic()
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            now = progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > stall_s:
                return None


def run_logged(
    cmd: list[str],
    log_path: Path,
    error: type[PipelineError],
    what: str,
    env: dict[str, str] | None = None,
    *,
    progress: Callable[[], int] | None = None,
    stall_s: float | None = None,
) -> None:
    """Run ``cmd`` appending its output to ``log_path``; raise ``error`` if it fails, or if
    ``progress()`` (a count of what it has produced) stands still for ``stall_s``: a tool that
    hangs is stopped rather than waited on for ever."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: %s (log %s)", what, " ".join(cmd), log_path)
    with open(log_path, "ab") as fh:
        proc, start = start_guarded(cmd, fh, env)
    try:
        code = wait_while_progressing(proc, progress, stall_s)
    finally:
        stop_guarded(proc, start)  # stalled or interrupted: the tool and its workers
    if code is None:
        raise error(
            f"{what} made no progress for {stall_s:.0f} s and was stopped; log {log_path}:\n"
            f"{log_tail(log_path)}"
        )
    if code:
        raise error(f"{what} failed with status {code}; log {log_path}:\n{log_tail(log_path)}")
