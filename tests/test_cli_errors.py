"""The command line's promise: a user error, or any error a server caused, ends a stage with one
line ``error: ...`` and exit status 2, never a traceback; anything else is a bug and raises."""

from __future__ import annotations

import httpx
import pytest

from pipeline.core.cli import report
from pipeline.core.errors import PipelineError
from pipeline.core.server_errors import ServerRejectedError

pytestmark = pytest.mark.unit


def failing(err: BaseException):
    def stage() -> dict:
        raise err

    return stage


def test_a_server_rejection_is_the_last_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        report(failing(ServerRejectedError(500, '{"error": "boom"}', "http://127.0.0.1:9/v1/x")))
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: http://127.0.0.1:9/v1/x answered HTTP 500: boom; the server failed (requests "
        "are retried generate.max_retries times): check its log and load, then rerun the stage "
        "(finished work is kept)"
    ]


def test_an_httpx_error_is_converted_at_the_same_place(capsys):
    request = httpx.Request("GET", "http://127.0.0.1:9/metrics")
    response = httpx.Response(400, text="no metrics here", request=request)
    error = httpx.HTTPStatusError("400", request=request, response=response)
    with pytest.raises(SystemExit):
        report(failing(error))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: http://127.0.0.1:9/metrics answered HTTP 400: no metrics here;")


def test_a_quoted_log_tail_comes_before_the_one_error_line(capsys):
    message = (
        "speculators prepare-data failed with status 1; log /r/prepare-data.log:\nTraceback\n  x"
    )
    with pytest.raises(SystemExit):
        report(failing(PipelineError(message)))
    assert capsys.readouterr().err.splitlines() == [
        "  | Traceback",
        "  |   x",
        "error: speculators prepare-data failed with status 1; log /r/prepare-data.log "
        "(its last lines above)",
    ]


def test_a_bug_is_not_dressed_up_as_a_user_error():
    with pytest.raises(KeyError):
        report(failing(KeyError("choices")))
