"""Errors a server causes, as one user error each: the server, what it said, and the fix.

:func:`server_error` turns the transport errors of the chat client (aiohttp) and of httpx
(health, models, metrics) into a :class:`~pipeline.core.errors.PipelineError`, so the command
line reports every stage's server failures the same way, with no traceback.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx

from pipeline.core.errors import PipelineError

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
