"""Every stage that talks to a server, against one that answers 400 or 500: one line, exit 2.

A small aiohttp server on 127.0.0.1 answers ``/health``, ``/v1/models`` and ``/metrics`` as
vLLM does, and every other request (chat completions, the chat-template render endpoint) with
the status under test and a vLLM-shaped JSON error body. Each stage runs as ``make`` runs it,
pointed at that server by ``server.base_url``, its inputs seeded from the tiny run, retries
bounded. Whatever the server says, the stage must end with one line, ``error: ...``, naming the
failure and the fix, exit with status 2, and print no traceback of its own (a tool's log tail
is quoted, each line prefixed ``  | ``). No vLLM is started.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from aiohttp import web

from pipeline.core.config import load_profile
from tests.helpers import REPO, TEST_OVERRIDES, seed_run_dir, serving

pytestmark = pytest.mark.e2e

# stage -> (module, the stages seeded before it, what its last line must name besides the fix)
STAGES = {
    "generate": ("pipeline.generate", ("verifier",), "prompts failed"),
    "extract": ("pipeline.extract", ("verifier", "generate"), "prepare-data failed: http://"),
    "eval": ("eval", ("verifier", "generate", "train"), "completions answered"),
}
BOUNDED = [
    "generate.max_retries=1",
    "generate.request_timeout_s=10",
    "data.max_samples=8",  # generate: a handful of prompts, each failing
    "server.startup_timeout_s=30",
]


def refusing_server(status: int) -> web.Application:
    """vLLM's health, model list and (idle) metrics; ``status`` with its JSON error body for
    anything else."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "verifier"}]})

    async def refuse(request: web.Request) -> web.Response:
        await request.read()
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        error = {"message": f"refused on purpose with {status}", "type": kind, "code": status}
        return web.json_response({"error": error}, status=status)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", health)  # no counters yet: an idle server
    app.router.add_route("*", "/{anything:.*}", refuse)
    return app


async def run_against(status: int, module: str, overrides: list[str]) -> tuple[int, str]:
    async with serving(refusing_server(status)) as base:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--config", "configs/tiny.yaml",
            *overrides, f"server.base_url={base}",
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "PROGRESS": "0"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=300)
    return proc.returncode, stderr.decode()


@pytest.mark.parametrize("status", [400, 500])
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_refusing_server_ends_the_stage_in_one_line(tiny_trained, tmp_path, stage, status):
    module, seeded, names = STAGES[stage]
    overrides = [f"run.output_dir={tmp_path}", *TEST_OVERRIDES, *BOUNDED]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_trained, profile, seeded)
    if stage == "extract":  # one conversation: speculators retries each render 3 times, slowly
        responses = profile.run.run_dir / "generate" / "responses.jsonl"
        lines = responses.read_text().splitlines(keepends=True)
        responses.write_text(next(line for line in lines if not json.loads(line)["skip_reason"]))

    code, stderr = asyncio.run(run_against(status, module, overrides))

    lines = stderr.rstrip("\n").splitlines()
    last = lines[-1]
    assert code == 2, stderr[-3000:]
    assert last.startswith("error: ") and names in last, last
    own = [line for line in lines if not line.startswith("  | ")]
    assert not any(line.startswith("Traceback") for line in own), stderr[-3000:]
    assert not (profile.run.run_dir / stage / "manifest.json").exists()
    if stage == "generate":  # each prompt's failure is logged above; the stage counts them
        assert f"refused on purpose with {status}" in stderr
        assert "8 of 8 prompts failed after retries" in last and "rerun" in last
    else:  # the server's own words, its address, and what to do
        assert "127.0.0.1" in last
        assert f"answered HTTP {status}: refused on purpose with {status}; " in last
        assert "check" in last
