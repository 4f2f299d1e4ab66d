"""The one OpenAI-compatible chat client every stage uses: bounded retries on transient errors.

Transient means a transport error (connection refused or reset, a timeout) or an HTTP 5xx/429;
those are retried with exponential backoff and jitter. Any other HTTP error (4xx: a bad request,
a prompt over the context limit) is raised at once as :class:`ServerRejectedError`, since a retry
cannot fix it.

Every error a server can cause is a user error with one line naming the server, what it said and
the fix: :class:`ServerRejectedError` is a :class:`PipelineError`, and :func:`server_error`
turns the transport errors of this client and of httpx (health, models, metrics) into one, so
the command line (``pipeline/cli.py``) reports them all the same way, with no traceback.

Built on aiohttp: at the concurrency a hero run uses (128 requests in flight), httpx's connection
pool collapses to a few dozen requests per second on the same endpoint where aiohttp sustains
well over a thousand (`make bench` measures both).
"""

from __future__ import annotations

import asyncio
import json
import random
from types import TracebackType
from typing import Any

import aiohttp
import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from pipeline.errors import PipelineError

MAX_MESSAGE_CHARS = 300


def server_message(text: str) -> str:
    """What a server said, on one line: the ``message`` of an OpenAI/vLLM JSON error body, else
    the body itself, whitespace collapsed and cut to ``MAX_MESSAGE_CHARS``."""
    message: Any = text
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        found = error.get("message") if isinstance(error, dict) else error
        message = found or body.get("message") or body.get("detail") or text
    line = " ".join(str(message).split()) or "(empty body)"
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."


def context_length_exceeded(status: int, text: str) -> bool:
    """vLLM's 400 for a request over ``server.max_model_len``."""
    text = text.lower()
    return status == 400 and (
        "context length" in text or "max_model_len" in text or "too long" in text
    )


def fix_for_status(status: int, text: str) -> str:
    if context_length_exceeded(status, text):
        return (
            "the request does not fit the server's context: shorten the prompt or lower the "
            "stage's max_tokens, or serve with a larger server.max_model_len"
        )
    if status >= 500 or status == 429:
        return (
            "the server failed (requests are retried generate.max_retries times): check its "
            "log and load, then rerun the stage (finished work is kept)"
        )
    if status in (401, 403):
        return "the server refused access: check the deployment's credentials"
    if status == 404:
        return (
            "no such route or model there: check that server.base_url is a vLLM "
            "OpenAI-compatible server serving the verifier"
        )
    return (
        "the server refused the request: check its log and that server.base_url serves the "
        "verifier with the API this stage needs"
    )


class ServerRejectedError(PipelineError):
    """The server answered with an HTTP error status; ``text`` is its body."""

    def __init__(self, status: int, text: str, url: str):
        super().__init__(
            f"{url} answered HTTP {status}: {server_message(text)}; {fix_for_status(status, text)}"
        )
        self.status, self.text, self.url = status, text, url


class ServerUnreachableError(PipelineError):
    """A server could not be reached or did not answer in time; the message names it."""


def server_error(err: BaseException) -> PipelineError | None:
    """The one-line user error for a failure a server caused, or None for any other error."""
    if isinstance(err, PipelineError):
        return err
    if isinstance(err, httpx.HTTPStatusError):
        resp = err.response
        return ServerRejectedError(resp.status_code, resp.text, str(err.request.url))
    if isinstance(err, aiohttp.ClientResponseError):  # e.g. a 200 whose body is not JSON
        return ServerRejectedError(err.status, err.message, str(err.request_info.url))
    where = None
    if isinstance(err, httpx.RequestError):
        try:
            where = str(err.request.url)
        except RuntimeError:  # httpx raises when the error carries no request
            where = None
    elif isinstance(err, aiohttp.ClientConnectorError):
        where = f"{err.host}:{err.port}"
    elif not isinstance(err, aiohttp.ClientError | TimeoutError):
        return None
    what = "timed out" if isinstance(err, TimeoutError | httpx.TimeoutException) else "failed"
    if not isinstance(err, httpx.HTTPError):
        what += " after retries"  # this client's; httpx's requests here are single checks
    detail = " ".join(str(err).split()) or type(err).__name__
    return ServerUnreachableError(
        f"a request to the server{f' at {where}' if where else ''} {what} "
        f"({detail}): check that the server is running and reachable (server.base_url), or "
        "raise generate.request_timeout_s for a slow one"
    )


# What a request can fail with, transient or not; stages count these as a failed prompt.
REQUEST_ERRORS = (aiohttp.ClientError, TimeoutError, ServerRejectedError)


def is_transient(err: BaseException) -> bool:
    if isinstance(err, ServerRejectedError):
        return err.status >= 500 or err.status == 429
    return isinstance(err, aiohttp.ClientError | TimeoutError)


class ChatClient:
    """``async with ChatClient(...) as client: await client.complete(body)``."""

    def __init__(
        self,
        v1_url: str,
        *,
        concurrency: int,
        request_timeout_s: float,
        max_retries: int,
        min_backoff_s: float = 1,
        max_backoff_s: float = 60,
    ):
        self.url = f"{v1_url}/chat/completions"
        self._concurrency = concurrency
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=30)
        self._max_retries = max_retries
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        connector = aiohttp.TCPConnector(limit=self._concurrency)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        assert self._session is not None
        await self._session.close()

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None, "use ChatClient as an async context manager"
        async with self._session.post(self.url, json=body) as resp:
            if resp.status >= 400:
                raise ServerRejectedError(resp.status, await resp.text(), self.url)
            return await resp.json()

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /chat/completions, retrying transient failures up to ``max_retries`` times."""
        # The first attempt runs outside tenacity: its per-call set-up costs about as much as the
        # rest of the client's work on a request, and nearly every request succeeds first time.
        try:
            return await self._post(body)
        except REQUEST_ERRORS as err:
            if not is_transient(err) or self._max_retries == 0:
                raise
        # Backoff: min..2*min before the first retry, then doubling, each with min of jitter.
        await asyncio.sleep(random.uniform(self._min_backoff_s, 2 * self._min_backoff_s))
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self._max_retries),
            wait=wait_exponential_jitter(
                multiplier=2 * self._min_backoff_s,
                max=self._max_backoff_s,
                jitter=self._min_backoff_s,
            ),
            reraise=True,
        ):
            with attempt:
                return await self._post(body)
        raise AssertionError("unreachable: tenacity reraises the last error")
