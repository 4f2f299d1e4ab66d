"""A stand-in OpenAI-compatible endpoint for `make bench`: fixed latency, canned replies.

Benchmarks of the generation client need an endpoint that is never the bottleneck, so that the
client's own overhead shows: this one answers ``/v1/chat/completions`` after ``--delay-ms`` with
a short canned reply, ``/v1/models`` and ``/health``. It binds to loopback only. It is a load
target for benchmarks, never a substitute for vLLM in tests of the pipeline.

Run as: python -m pipeline.tools.bench_endpoint --port N --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

REPLY = "A canned reply of a few words, the same for every request."


def make_app(delay_s: float) -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        await asyncio.sleep(delay_s)
        return JSONResponse(
            {
                "id": "bench",
                "object": "chat.completion",
                "model": body.get("model", "bench"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": REPLY},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 16, "completion_tokens": 12, "total_tokens": 28},
            }
        )

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench endpoint")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=20)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.delay_ms / 1000),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
