"""Command-line plumbing shared by every stage: parse, load the profile, run, report.

Deliberately limited to argument parsing and error reporting; stage logic lives in the stage
modules. Every stage is run as ``python -m <module> --config PROFILE [section.field=value ...]``.

Invariant: a stage that fails on a user error (a :class:`PipelineError`, or any error a server
caused: an HTTP error status, a refused connection, a timeout) ends with exactly one line,
``error: <the thing and the fix>``, and exit status 2, never a traceback. Detail lines of a
message (the quoted tail of a log) come before that line, each prefixed ``  | ``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from pipeline.core.config import Profile, load_profile
from pipeline.core.errors import PipelineError
from pipeline.core.server_errors import server_error


def stage_parser(stage: str) -> argparse.ArgumentParser:
    """``--config PROFILE [section.field=value ...]``; a stage may add flags of its own."""
    parser = argparse.ArgumentParser(prog=f"stage {stage}")
    parser.add_argument("--config", required=True, help="profile YAML, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    return parser


def parse(stage: str, argv: list[str] | None) -> tuple[Profile, argparse.Namespace]:
    args = stage_parser(stage).parse_args(argv)
    return load_profile(args.config, args.overrides), args


class Terminated(BaseException):
    """SIGTERM (`docker stop`, a scheduler's preemption) arrived: unwind like Ctrl-C, so every
    ``finally`` runs and the servers a stage started are stopped."""


def _terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def report(fn: Callable[[], dict[str, Any]]) -> None:
    """Run a stage body: log setup, a user error as one line and exit 2, a summary on success."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for client in ("httpx", "httpx2"):  # one line per request otherwise
        logging.getLogger(client).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        manifest = fn()
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C); what was finished is kept: rerun the stage to do the rest")
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(
            "error: stopped by SIGTERM; what was finished is kept: rerun the stage to do the rest",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGTERM)
    except Exception as err:
        user_error = server_error(err)  # a PipelineError, or what a server caused, as one
        if user_error is None:
            raise
        fail(str(user_error))
    summary = {k: manifest.get(k) for k in ("stage", "counts", "wall_time_s", "bytes")}
    print(json.dumps(summary))


def fail(message: str) -> None:
    """Print ``message`` as the stage's last line, ``error: ...``, and exit 2; any lines after
    its first (a log's tail) go before it, marked as quoted."""
    headline, *details = message.strip().splitlines() or ["(no message)"]
    for line in details:
        print(f"  | {line}", file=sys.stderr)
    if details and headline.endswith(":"):
        headline = headline[:-1] + " (its last lines above)"
    print(f"error: {headline}", file=sys.stderr)
    sys.exit(2)


def run_stage(
    stage: str,
    fn: Callable[[Profile], dict[str, Any]],
    argv: list[str] | None,
    merge: Callable[[Profile], dict[str, Any]] | None = None,
) -> None:
    """Run ``fn``; a sharded stage (``merge`` given) also takes ``--merge``: put the finished
    shards of ``run.shard=k/S`` runs together instead (pipeline.core.shards)."""
    parser = stage_parser(stage)
    if merge:
        parser.add_argument("--merge", action="store_true", help="merge the finished shards")
    args = parser.parse_args(argv)

    def body() -> dict[str, Any]:
        profile = load_profile(args.config, args.overrides)
        if not merge or args.merge:
            unsharded(profile)
        return (merge if merge and args.merge else fn)(profile)

    report(body)


def unsharded(profile: Profile) -> Profile:
    """``profile``, refused with the fix when it names a shard: only generate and extract run
    by shard (pipeline.core.shards), and a merge reads every shard."""
    if profile.run.shard:
        raise PipelineError(
            f"run.shard={profile.run.shard}: only generate and extract run by shard, and a "
            "merge reads every shard; drop run.shard for this command"
        )
    return profile
