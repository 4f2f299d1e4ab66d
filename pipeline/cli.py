"""Command-line plumbing shared by every stage: parse, load the profile, run, report.

Deliberately limited to argument parsing and error reporting; stage logic lives in the stage
modules. Every stage is run as ``python -m <module> --config PROFILE [section.field=value ...]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from pipeline.config import Profile, load_profile
from pipeline.errors import PipelineError


def stage_parser(stage: str) -> argparse.ArgumentParser:
    """``--config PROFILE [section.field=value ...]``; a stage may add flags of its own."""
    parser = argparse.ArgumentParser(prog=f"stage {stage}")
    parser.add_argument("--config", required=True, help="profile YAML, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    return parser


def parse(stage: str, argv: list[str] | None) -> tuple[Profile, argparse.Namespace]:
    args = stage_parser(stage).parse_args(argv)
    return load_profile(args.config, args.overrides), args


def report(fn: Callable[[], dict[str, Any]]) -> None:
    """Run a stage body: log setup, a user error as one line and exit 2, a summary on success."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for client in ("httpx", "httpx2"):  # one line per request otherwise
        logging.getLogger(client).setLevel(logging.WARNING)
    try:
        manifest = fn()
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    summary = {k: manifest.get(k) for k in ("stage", "counts", "wall_time_s", "bytes")}
    print(json.dumps(summary))


def run_stage(stage: str, fn: Callable[[Profile], dict[str, Any]], argv: list[str] | None) -> None:
    report(lambda: fn(parse(stage, argv)[0]))
