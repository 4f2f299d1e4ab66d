"""`responses.jsonl` holds the current selection of prompts only, and a pilot's work is reused.

The generate stage runs for real against a chat-completions peer on 127.0.0.1 (an aiohttp app
in a thread of its own, since the stage runs its own event loop) that counts what it is asked.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from pipeline import generate
from pipeline.core.config import load_profile
from pipeline.core.prompts import load_prompt_set
from pipeline.serving.vllm_api import LOOPBACK, free_port
from tests.helpers import stand_in_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
DATA = "data/prompts/tiny-blend.jsonl"


@pytest.fixture
def chat_peer() -> Iterator[tuple[str, list[str]]]:
    """A chat-completions peer on 127.0.0.1; yields its url and the conversations it was asked
    to start (their first user turn: a multi-turn conversation asks once per user turn)."""
    asked: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if not any(m["role"] == "assistant" for m in body["messages"]):
            asked.append(body["messages"][-1]["content"])
        return web.json_response(
            {
                "choices": [{"message": {"content": "an answer"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            }
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "verifier"}]})

    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port(LOOPBACK)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, LOOPBACK, port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{port}", asked
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def ids(path: Path) -> list[str]:
    return (
        [json.loads(line)["id"] for line in path.read_text().splitlines()] if path.exists() else []
    )


def test_a_smaller_sample_parks_the_rest_and_a_larger_one_reuses_the_pilot(tmp_path, chat_peer):
    url, asked = chat_peer

    def run(samples: int) -> dict:
        profile = load_profile(
            REPO / "configs/tiny.yaml",
            [f"run.output_dir={tmp_path}", f"server.base_url={url}", f"data.max_samples={samples}"],
        )
        stand_in_manifest(profile, "verifier", model="v")
        return generate.run(profile)

    folder = tmp_path / "tiny" / "generate"
    pilot = run(16)
    pilot_ids = ids(folder / generate.RESPONSES)
    assert len(asked) == len(pilot_ids) == 16 == pilot["counts"]["succeeded"]

    full = run(64)  # the pilot's 16 are part of the 64: only 48 more are asked
    assert len(asked) == 64 and full["counts"]["succeeded"] == 64
    assert set(pilot_ids) < set(ids(folder / generate.RESPONSES))

    fewer = run(8)  # nothing asked; 56 records set aside, not lost
    assert len(asked) == 64 and fewer["counts"] == fewer["counts"] | {"input": 8, "succeeded": 8}
    expected = {r.id for r in load_prompt_set(DATA, None, "train", 8).rows}
    assert set(ids(folder / generate.RESPONSES)) == expected
    assert len(ids(folder / generate.UNSELECTED)) == 56

    again = run(64)  # all 64 back from the side file, none asked again
    assert len(asked) == 64 and again["counts"]["succeeded"] == 64
    assert sorted(ids(folder / generate.RESPONSES)) == sorted(set(ids(folder / generate.RESPONSES)))
    assert not (folder / generate.UNSELECTED).exists()


def test_a_record_in_both_files_after_a_crash_counts_once(tmp_path):
    record = {"id": "a", "source": "s", "conversations": [], "skip_reason": None}
    line = json.dumps(record) + "\n"
    (tmp_path / generate.RESPONSES).write_text(line + json.dumps({**record, "id": "b"}) + "\n{")
    (tmp_path / generate.UNSELECTED).write_text(line)
    assert generate.select_records(tmp_path, {"a", "b"}) == {"a", "b"}
    assert ids(tmp_path / generate.RESPONSES) == ["a", "b"]  # the torn line cut, "a" once
    assert not (tmp_path / generate.UNSELECTED).exists()
