"""A vLLM OpenAI-compatible server as every stage and runtime talks to it.

One builder of the server command line (:func:`server_command`: model, loopback host and port,
tensor parallelism, KV cache dtype, reasoning parser, speculative and KV-transfer configs) and
of its environment (:func:`vllm_env`, which pins vLLM's internal traffic to loopback), one
health wait with progress (:func:`wait_until_healthy`), and :class:`Endpoint`, what a stage
holds of a server it started or attached to. The runtimes, a child process
(:mod:`pipeline.serving.vllm_server`) or a container (:mod:`pipeline.serving.server_container`),
both start exactly this command.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.core.config import Profile
from pipeline.core.errors import PipelineError
from pipeline.core.model_names import served_revision
from pipeline.core.portable import REPO_ROOT
from pipeline.core.progress import progress
from pipeline.core.serving_platform import Platform, server_platform
from pipeline.serving.cpu_workarounds import CPU_SERVER_ARGS, PLUGIN_ENV
from pipeline.serving.logged_process import log_tail

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
VLLM_API_MODULE = "vllm.entrypoints.openai.api_server"


class ServerError(PipelineError):
    """The vLLM server could not be started or reached."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the served model name the API expects
    started_here: bool
    log_path: Path | None = None
    pid: int | None = None  # the server's guard and process group when started here
    container: str | None = None  # the server's container when server.runtime=docker

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_args(
    profile: Profile,
    model: str,
    port: int,
    *,
    speculative_config: dict[str, Any] | None = None,
    kv_transfer_config: dict[str, Any] | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    served_model_name: str = "verifier",
    platform: Platform | None = None,
) -> list[str]:
    """vLLM's arguments for this profile: one place, for every stage, machine and runtime.

    ``platform``: the one vLLM serves on (default: :func:`server_platform`); the CPU adds the
    CPU workarounds' flags and refuses a profile's CUDA attention backends."""
    s, v = profile.server, profile.verifier
    platform = platform or server_platform(profile)
    cmd = [
        "--model", model,
        "--served-model-name", served_model_name,
        "--host", s.host,
        "--port", str(port),
        "--dtype", v.dtype,
        "--max-model-len", str(s.max_model_len),
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--seed", str(profile.run.seed),
        "--kv-cache-dtype", s.kv_cache_dtype,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if revision := served_revision(profile):
        cmd += ["--revision", revision]
    if v.trust_remote_code:
        cmd.append("--trust-remote-code")
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    if s.max_num_seqs:
        cmd += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.reasoning_parser:
        cmd += ["--reasoning-parser", s.reasoning_parser]
    if s.language_model_only:
        cmd.append("--language-model-only")
    if platform == "cpu":
        draft_backend = (speculative_config or {}).get("attention_backend")
        if s.attention_backend or draft_backend:
            raise ServerError(
                f"attention backend {s.attention_backend or draft_backend} "
                f"({'server.attention_backend' if s.attention_backend else 'the drafter'}'s) is "
                "for CUDA, but this vLLM serves on the CPU, which uses its own: drop the backend "
                "fields (server.attention_backend, server.draft_attention_backend, "
                "eval.reference_drafters[].attention_backend) or run a CPU profile such as "
                "configs/tiny.yaml"
            )
        cmd += CPU_SERVER_ARGS
    elif s.attention_backend:
        cmd += ["--attention-backend", s.attention_backend]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return [*cmd, *s.extra_args, *extra_args]


def chat_template_sha256(template: str) -> str:
    """The hash a chat template is recorded and compared by (the verifier's, and a server's)."""
    return hashlib.sha256(template.encode()).hexdigest()


def served_chat_template_sha256(extra_args: list[str], own_sha256: str) -> str:
    """The sha256 of the chat template a server given ``extra_args`` applies: that of a
    ``--chat-template`` among them (a file, or the template itself, as vLLM takes either), else
    ``own_sha256``, the verifier's own template's."""
    value = None
    for i, arg in enumerate(extra_args):
        if arg == "--chat-template" and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        elif arg.startswith("--chat-template="):
            value = arg.split("=", 1)[1]
    if value is None:
        return own_sha256
    path = Path(value)
    return chat_template_sha256(path.read_text() if path.is_file() else value)


def server_command(profile: Profile, model: str, port: int, **kwargs: Any) -> list[str]:
    """The command line that starts this profile's server with this machine's Python."""
    return [sys.executable, "-m", VLLM_API_MODULE, *server_args(profile, model, port, **kwargs)]


def vllm_env(profile: Profile) -> dict[str, str]:
    """What a server needs in its environment, on any runtime: loopback-only internal traffic,
    no telemetry, and no Hub lookups (every file a server reads is on disk first)."""
    env = {
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_LOOPBACK_IP": LOOPBACK,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if server_platform(profile) == "cpu":
        env[PLUGIN_ENV] = "1"
        # The model runs inside the engine core process instead of a worker process of its
        # own: the same replies, about 13 s less per start on a 2-core CPU (measured in
        # docs/measurements.md); the CUDA build keeps its multiprocess executor.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if profile.server.cpu_kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(profile.server.cpu_kv_cache_gib)
    # Every file a server reads is on disk first: a local or built verifier, a Hub verifier's
    # snapshot (the verifier stage downloads it whole; offline, its id resolves to that commit),
    # and drafters (eval fetches a Hub drafter before serving it).
    env["HF_HUB_OFFLINE"] = "1"
    return env


def server_env(profile: Profile) -> dict[str, str]:
    env = dict(os.environ)
    # The repository root on the path: vLLM imports our KV connector by module name.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env | vllm_env(profile)


def served_model(base_url: str, timeout: float = 10) -> str:
    resp = httpx.get(f"{base_url}/v1/models", timeout=timeout)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def wait_until_healthy(
    base_url: str,
    timeout_s: float,
    exited: Callable[[], str | None] | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll ``/health`` until it answers 200, showing elapsed time; fail fast once ``exited``
    says why the server is gone (it returns None while the server runs)."""
    deadline = time.monotonic() + timeout_s
    log.info("waiting up to %.0fs for vLLM at %s to load and answer /health", timeout_s, base_url)
    bar = progress(total=int(timeout_s), desc=f"waiting for vLLM at {base_url}", unit="s")
    started = time.monotonic()
    try:
        while True:
            if exited is not None and (why := exited()) is not None:
                tail = log_tail(log_path) if log_path else ""
                raise ServerError(f"{why} while loading; log {log_path}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vLLM at {base_url} was not healthy after {timeout_s:.0f}s; raise "
                    "server.startup_timeout_s if the model is still loading"
                    + (f"; log {log_path}:\n{log_tail(log_path)}" if log_path else "")
                )
            time.sleep(1)
            bar.n = int(time.monotonic() - started)
            bar.refresh()
    finally:
        bar.close()


def attach(url: str, timeout_s: float) -> Endpoint:
    """A running server at ``url`` (with or without /v1), once it answers /health."""
    base = url.rstrip("/").removesuffix("/v1")
    wait_until_healthy(base, timeout_s)
    return Endpoint(base_url=base, model=served_model(base), started_here=False)
