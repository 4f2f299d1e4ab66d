"""A stand-in for vLLM's OpenAI server process, for tests of how servers are run (not of vLLM):
it takes vLLM's arguments, reads only --host, --port and --served-model-name, and then serves
/health and /v1/models (``ok``), exits with status 3 while "loading" (``crash``), or never
answers (``hang``). It says on stdout what it was started with and how it was stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from aiohttp import web


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "crash", "hang"], required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="verifier")
    args, rest = parser.parse_known_args()
    print(f"stub vllm: mode={args.mode} host={args.host} port={args.port} uid={os.getuid()}")
    print(f"stub vllm: args {' '.join(rest)}", flush=True)

    def on_sigterm(*_: object) -> None:
        print("stub vllm: stopped by SIGTERM", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.mode == "crash":
        print("stub vllm: ValueError: the model does not fit (on purpose)", flush=True)
        sys.exit(3)
    if args.mode == "hang":
        while True:
            time.sleep(1)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": args.served_model_name}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=False)


if __name__ == "__main__":
    main()
