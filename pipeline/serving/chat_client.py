"""The one OpenAI-compatible chat client every stage uses: bounded retries on transient errors.

Transient means a transport error (connection refused or reset, a timeout) or an HTTP 5xx/429;
those are retried with exponential backoff and jitter. Any other HTTP error (4xx: a bad request,
a prompt over the context limit) is raised at once as :class:`ServerRejectedError`, since a retry
cannot fix it.

Every error a server can cause is a user error with one line naming the server, what it said and
the fix (:mod:`pipeline.core.server_errors`), so the command line reports them all the same way,
with no traceback.

Built on aiohttp: at the concurrency a hero run uses (128 requests in flight), httpx's connection
pool collapses to a few dozen requests per second on the same endpoint where aiohttp sustains
well over a thousand (`make bench` measures both).
"""

from __future__ import annotations

import asyncio
import random
from types import TracebackType
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from pipeline.core.server_errors import ServerRejectedError

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
        path: str = "chat/completions",
    ):
        self.url = f"{v1_url}/{path}"
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
        """POST the request (to /chat/completions unless ``path`` said another, e.g. the raw
        /completions), retrying transient failures up to ``max_retries`` times."""
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
