"""Serve the profile's verifier in the foreground, alone or with the trained drafter.

The compose services `verifier` and `eval` run this, so a long-lived server has exactly the
command line every stage starts (``server_command``): tensor parallelism, KV cache dtype,
reasoning parser, loopback host. ``--drafter`` adds the EAGLE-3 speculative config of the
run's trained drafter at the k eval measured best (else the largest k eval sweeps).

``--print`` writes the command line as JSON and exits; otherwise this process becomes vLLM
(exec), so signals from the container runtime reach it directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from pipeline.core.cli import stage_parser
from pipeline.core.config import Profile, load_profile
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import StageInputError, stage_manifest
from pipeline.core.model_names import verifier_path
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import server_command, server_env


def drafter_speculative_config(profile: Profile, k: int | None) -> dict[str, Any]:
    """EAGLE-3 with the run's trained drafter, as eval served it."""
    drafter = stage_manifest(profile, "train").outputs.drafter
    if k is None:
        k = max(profile.eval.num_speculative_tokens)
        # The k eval measured best, when eval measured this drafter (it may be stale, or not run).
        with contextlib.suppress(StageInputError):
            summary = stage_manifest(profile, "eval").outputs.summary
            if summary.get("series", "eagle3") in ("eagle3", "served"):  # not a reference's
                k = summary["num_speculative_tokens"]
    return speculative_config(profile, "eagle3", k, drafter)


def command(profile: Profile, args: argparse.Namespace) -> list[str]:
    spec = (
        drafter_speculative_config(profile, args.num_speculative_tokens) if args.drafter else None
    )
    port = args.port or profile.server.port or 8000
    return server_command(
        profile, verifier_path(profile), port, speculative_config=spec, platform=args.platform
    )


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser("serve")
    parser.add_argument("--port", type=int, default=None, help="default server.port, else 8000")
    parser.add_argument("--drafter", action="store_true", help="speculate with the drafter")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--print", action="store_true", help="print the command line and exit")
    parser.add_argument(
        "--platform", choices=("cpu", "cuda"), default=None,
        help="the platform to build the command for (default: this vLLM's; with --print)",
    )  # fmt: skip
    args = parser.parse_intermixed_args(argv)
    try:
        profile = load_profile(args.config, args.overrides)
        cmd = command(profile, args)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.print:
        print(json.dumps(cmd))
        return
    print("serving:", " ".join(cmd), file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, server_env(profile))


if __name__ == "__main__":
    main()
