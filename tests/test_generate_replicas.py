"""Generation over several servers (generate.replica_urls), over real HTTP on 127.0.0.1.

The servers are small aiohttp peers speaking the chat-completions shape with a set latency or
status, so that what is measured is generate's fan-out: every prompt done exactly once, a faster
replica taking more, a dead replica's prompts counted as failed and not lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from pipeline.config import load_profile
from pipeline.generate import ResponseWriter, finished_ids, regenerate_all
from pipeline.prompts import PromptRow
from pipeline.vllm_server import Endpoint
from tests.helpers import serving

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
PROMPTS = 60


@contextlib.asynccontextmanager
async def replica(delay_s: float, status: int = 200) -> AsyncIterator[str]:
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay_s)
        if status != 200:
            return web.Response(status=status, text="replica down on purpose")
        content = f"answer to {body['messages'][-1]['content']}"
        return web.json_response(
            {
                "choices": [
                    {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as base:
        yield base


def rows() -> list[PromptRow]:
    return [
        PromptRow(id=f"p{i}", source="test", messages=({"role": "user", "content": f"q{i}"},))
        for i in range(PROMPTS)
    ]


def spread(tmp_path: Path, replicas: list[tuple[float, int]]) -> list[dict]:
    profile = load_profile(
        REPO / "configs/tiny.yaml",
        [f"run.output_dir={tmp_path}", "generate.concurrency=4", "generate.max_retries=0"],
    )

    async def scenario() -> list[dict]:
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(replica(*r)) for r in replicas]
            endpoints = [Endpoint(base_url=u, model="verifier", started_here=False) for u in urls]
            writer = ResponseWriter(tmp_path / "responses.jsonl")
            try:
                return await regenerate_all(profile, endpoints, rows(), writer)
            finally:
                writer.close()

    return asyncio.run(scenario())


def test_every_prompt_is_done_once_and_the_faster_replica_does_more(tmp_path):
    tally = spread(tmp_path, [(0.08, 200), (0.01, 200)])
    assert [t["failed"] for t in tally] == [0, 0]
    assert sum(t["finished"] for t in tally) == PROMPTS
    assert tally[1]["finished"] > 2 * tally[0]["finished"] > 0
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in records) == sorted(r.id for r in rows())
    assert all(r["conversations"][-1]["value"].startswith("answer to q") for r in records)


def test_a_dead_replicas_prompts_fail_and_are_left_for_the_rerun(tmp_path):
    tally = spread(tmp_path, [(0.0, 503), (0.02, 200)])
    failed, finished = tally[0]["failed"], tally[1]["finished"]
    assert failed > 0 and tally[0]["finished"] == 0 and tally[1]["failed"] == 0
    assert failed + finished == PROMPTS
    done = finished_ids(tmp_path / "responses.jsonl")
    assert len(done) == finished  # written once each; the failed ones are not written
