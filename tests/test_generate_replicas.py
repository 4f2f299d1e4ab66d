"""Generation over several servers (generate.replica_urls), over real HTTP on 127.0.0.1.

The servers are small aiohttp peers speaking the chat-completions shape with a set status, so
that what is measured is generate's fan-out: every prompt done exactly once, a faster replica
taking more, a dead replica's prompts counted as failed and not lost. Nothing is timed: a slow
replica is one that holds its requests until every prompt has been sent to some replica, so
what each replica does follows from the protocol alone, however loaded the machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from pipeline.core.config import load_profile
from pipeline.core.prompts import PromptRow
from pipeline.generate import ResponseWriter, finished_ids, regenerate_all
from pipeline.serving.vllm_api import Endpoint
from tests.helpers import serving

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
PROMPTS = 60
CONCURRENCY = 4  # generate.concurrency: requests in flight on each replica
HOLD_S = 30  # a slow replica's longest hold; the test takes milliseconds when all goes well


class Pace:
    """Counts requests as they arrive at any replica; ``all_sent`` is set at the last prompt."""

    def __init__(self) -> None:
        self.arrived = 0
        self.all_sent = asyncio.Event()

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == PROMPTS:
            self.all_sent.set()


@contextlib.asynccontextmanager
async def replica(pace: Pace, *, slow: bool = False, status: int = 200) -> AsyncIterator[str]:
    """A chat-completions peer; a ``slow`` one answers only once every prompt has been sent."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        pace.arrive()
        if slow:
            # Bounded, so that a fan-out that never sends every prompt fails the test, not hangs.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pace.all_sent.wait(), HOLD_S)
            pace.all_sent.set()
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


def spread(tmp_path: Path, replicas: list[dict]) -> list[dict]:
    profile = load_profile(
        REPO / "configs/tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            f"generate.concurrency={CONCURRENCY}",
            "generate.max_retries=0",
            "generate.request_timeout_s=60",  # above HOLD_S
        ],
    )

    async def scenario() -> list[dict]:
        pace = Pace()
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(replica(pace, **r)) for r in replicas]
            endpoints = [Endpoint(base_url=u, model="verifier", started_here=False) for u in urls]
            writer = ResponseWriter(tmp_path / "responses.jsonl")
            try:
                tally, _ = await regenerate_all(profile, endpoints, rows(), writer)
                return tally
            finally:
                writer.close()

    return asyncio.run(scenario())


def test_every_prompt_is_done_once_and_the_faster_replica_does_more(tmp_path):
    tally = spread(tmp_path, [{"slow": True}, {}])
    assert [t["failed"] for t in tally] == [0, 0]
    # Each worker takes a prompt at the start; the slow replica's hold theirs while the fast
    # replica's free workers take every other prompt from the shared queue.
    assert [t["finished"] for t in tally] == [CONCURRENCY, PROMPTS - CONCURRENCY]
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in records) == sorted(r.id for r in rows())
    assert all(r["conversations"][-1]["value"].startswith("answer to q") for r in records)


def test_a_dead_replicas_prompts_fail_and_are_left_for_the_rerun(tmp_path):
    tally = spread(tmp_path, [{"status": 503}, {}])
    failed, finished = tally[0]["failed"], tally[1]["finished"]
    assert failed > 0 and tally[0]["finished"] == 0 and tally[1]["failed"] == 0
    assert failed + finished == PROMPTS
    done = finished_ids(tmp_path / "responses.jsonl")
    assert len(done) == finished  # written once each; the failed ones are not written
