"""The chat client over real HTTP on 127.0.0.1: what it retries, what it raises at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pipeline.chat_client import ChatClient, ServerRejectedError
from pipeline.vllm_server import LOOPBACK, free_port
from tests.helpers import serving

pytestmark = pytest.mark.unit

REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}


@contextlib.asynccontextmanager
async def server_answering(statuses: list[int]) -> AsyncIterator[tuple[str, list[int]]]:
    """A server giving ``statuses`` in order, then 200; yields its /v1 url and the statuses sent."""
    sent: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        await request.json()
        status = statuses[len(sent)] if len(sent) < len(statuses) else 200
        sent.append(status)
        if status == 200:
            return web.json_response(REPLY)
        return web.Response(status=status, text=f"status {status} on purpose")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as base:
        yield f"{base}/v1", sent


def client(v1: str, max_retries: int) -> ChatClient:
    return ChatClient(
        v1, concurrency=4, request_timeout_s=10, max_retries=max_retries, min_backoff_s=0.01
    )


def test_5xx_and_429_are_retried_until_success():
    async def scenario() -> list[int]:
        async with server_answering([503, 429, 500]) as (v1, sent), client(v1, 3) as c:
            assert await c.complete({"messages": []}) == REPLY
            return sent

    assert asyncio.run(scenario()) == [503, 429, 500, 200]


def test_retries_stop_at_the_limit_with_the_last_error():
    async def scenario() -> list[int]:
        async with server_answering([503] * 10) as (v1, sent), client(v1, 2) as c:
            with pytest.raises(ServerRejectedError) as info:
                await c.complete({"messages": []})
            assert info.value.status == 503 and "on purpose" in info.value.text
            return sent

    assert asyncio.run(scenario()) == [503, 503, 503]


def test_a_4xx_is_raised_at_once():
    async def scenario() -> list[int]:
        async with server_answering([400]) as (v1, sent), client(v1, 5) as c:
            with pytest.raises(ServerRejectedError) as info:
                await c.complete({"messages": []})
            assert info.value.status == 400
            return sent

    assert asyncio.run(scenario()) == [400]


def test_connection_refused_is_retried_then_raised():
    async def scenario() -> None:
        v1 = f"http://{LOOPBACK}:{free_port(LOOPBACK)}/v1"  # nothing listens there
        async with client(v1, 2) as c:
            with pytest.raises(OSError):
                await c.complete({"messages": []})

    asyncio.run(scenario())
