"""The one OpenAI-compatible chat client every stage uses: bounded retries on transient errors.

Transient means a transport error (connection refused or reset, timeout) or an HTTP 5xx/429;
those are retried with exponential backoff and jitter. Any other HTTP error (4xx: a bad request,
a prompt over the context limit) is raised at once, since a retry cannot fix it.
"""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter


def is_transient(err: BaseException) -> bool:
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code >= 500 or err.response.status_code == 429
    return isinstance(err, httpx.TransportError)


async def chat_completion(
    client: httpx.AsyncClient,
    v1_url: str,
    body: dict[str, Any],
    *,
    max_retries: int,
    max_backoff_s: float = 60,
) -> dict[str, Any]:
    """POST /chat/completions, retrying transient failures up to ``max_retries`` times."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(max_retries + 1),
        wait=wait_exponential_jitter(initial=1, max=max_backoff_s),
        reraise=True,
    ):
        with attempt:
            resp = await client.post(f"{v1_url}/chat/completions", json=body)
            resp.raise_for_status()
            return resp.json()
    raise AssertionError("unreachable: tenacity reraises the last error")
