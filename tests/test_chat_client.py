"""The chat client over real HTTP on 127.0.0.1: what it retries, what it raises at once, and the
one-line user error every failure a server causes becomes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from pipeline.core.errors import PipelineError
from pipeline.core.server_errors import (
    ServerRejectedError,
    ServerUnreachableError,
    server_error,
)
from pipeline.serving.chat_client import ChatClient
from pipeline.serving.vllm_api import LOOPBACK, free_port
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


VLLM_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 1024 tokens. However, you requested\n"
        "1300 tokens (1204 in the messages, 96 in the completion).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def test_a_rejection_is_one_line_naming_the_server_what_it_said_and_the_fix():
    async def chat(request: web.Request) -> web.Response:
        return web.json_response(VLLM_TOO_LONG, status=400)

    async def scenario() -> ServerRejectedError:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with serving(app) as base, client(f"{base}/v1", 3) as c:
            with pytest.raises(ServerRejectedError) as info:
                await c.complete({"messages": []})
            return info.value

    err = asyncio.run(scenario())
    assert isinstance(err, PipelineError) and err.status == 400
    assert err.text == json.dumps(VLLM_TOO_LONG)  # the body as sent, for callers to inspect
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"http://{LOOPBACK}:")
    said = "This model's maximum context length is 1024 tokens. However, you requested 1300"
    assert f"/v1/chat/completions answered HTTP 400: {said} tokens (1204 in the messages" in message
    assert "shorten the prompt or lower the stage's max_tokens" in message
    assert "server.max_model_len" in message


@pytest.mark.parametrize(
    ("status", "fix"),
    [(500, "retried generate.max_retries times"), (404, "check that server.base_url")],
)
def test_other_statuses_name_their_fix(status, fix):
    err = ServerRejectedError(status, "<html>\n<h1>Oops</h1>\n</html>", "http://h/v1/x")
    assert str(err).startswith(f"http://h/v1/x answered HTTP {status}: <html> <h1>Oops</h1>")
    assert fix in str(err) and "\n" not in str(err)


def test_httpx_status_errors_become_the_same_user_error():
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(status=503, text="engine is dead (on purpose)")

    async def scenario() -> BaseException:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with serving(app) as base:
            async with httpx.AsyncClient() as http:
                resp = await http.get(f"{base}/metrics")
            try:
                resp.raise_for_status()
            except httpx.HTTPStatusError as err:
                return err
        raise AssertionError("no error raised")

    err = server_error(asyncio.run(scenario()))
    assert isinstance(err, ServerRejectedError) and err.status == 503
    assert "/metrics answered HTTP 503: engine is dead (on purpose); the server failed" in (
        str(err)
    )


def test_unreachable_and_slow_servers_become_one_line_user_errors():
    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response(REPLY)

    async def scenario() -> tuple[BaseException, BaseException]:
        v1 = f"http://{LOOPBACK}:{free_port(LOOPBACK)}/v1"  # nothing listens there
        async with client(v1, 0) as c:
            with pytest.raises(OSError) as refused:
                await c.complete({"messages": []})
        app = web.Application()
        app.router.add_post("/v1/chat/completions", slow)
        async with serving(app) as base:
            quick = ChatClient(f"{base}/v1", concurrency=1, request_timeout_s=0.2, max_retries=0)
            async with quick:
                with pytest.raises(TimeoutError) as timed_out:
                    await quick.complete({"messages": []})
        return refused.value, timed_out.value

    refused, timed_out = asyncio.run(scenario())
    for err, what in ((refused, "failed after retries"), (timed_out, "timed out after retries")):
        user_error = server_error(err)
        assert isinstance(user_error, ServerUnreachableError), err
        assert what in str(user_error) and "\n" not in str(user_error)
        assert "check that the server is running" in str(user_error)
    assert f"{LOOPBACK}:" in str(server_error(refused))


def test_errors_no_server_caused_are_left_alone():
    assert server_error(ValueError("a bug")) is None
    assert server_error(KeyError("choices")) is None
