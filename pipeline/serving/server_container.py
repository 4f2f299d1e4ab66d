"""Run a stage's vLLM server as a Docker container through the Engine API (docker SDK).

``server.runtime=docker`` makes every server a stage starts (generate's verifier, extract's
hidden-state server, each eval arm) a container of ``server.container.image`` instead of a
child process. A host holds one such server at a time: the stage that needs one owns the GPUs
for its ``with`` block, so extract and eval can bring the verifier up with other flags.

Invariants:
- the container runs exactly the vLLM arguments a child process would (``server_args``), with
  the image's Python, in the host's network namespace, bound to ``server.host`` (loopback):
  reachable from this process, on the host or in a host-network container, and nowhere else;
- it reserves the GPUs the profile names through device requests; it gets vLLM's environment
  (``vllm_env``) and the HF cache location, never the HF token or the rest of this environment;
- it runs as this process's uid:gid, so what it writes into the run folder belongs to the run;
  with the default same-path mounts it also runs in this process's working directory, so a
  relative path (a tiny profile's ``runs/...``) names the same file inside;
- it is stopped and removed when the ``with`` block ends, on success, error, Ctrl-C and SIGTERM,
  its whole log in the stage's log file (followed from before it starts, so a server that dies
  at once still leaves its log);
- it does not outlive the stage even when the stage is killed outright (SIGKILL, or the whole
  pipeline container killed): its first process is the server guard, which stops vLLM when the
  loopback lifeline the stage holds closes, and the engine removes the container when it exits
  (auto-remove); a container of the same run whose owner is gone is removed before the next one
  starts all the same;
- an unreachable engine, a missing image, a container that exits while loading or never
  becomes healthy raise :class:`~pipeline.serving.vllm_server.ServerError` naming it and the fix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import DeviceRequest
from huggingface_hub import constants as hub_constants

from pipeline.core.config import ContainerConfig, Profile
from pipeline.core.model_names import looks_like_path
from pipeline.serving.server_guard import MODULE as GUARD_MODULE
from pipeline.serving.server_guard import owner_alive, owner_id
from pipeline.serving.vllm_api import VLLM_API_MODULE, ServerError, vllm_env, wait_until_healthy

log = logging.getLogger(__name__)
LABEL_RUN = "eagle3-release.run"
LABEL_OWNER = "eagle3-release.owner"
VLLM_COMMAND = ["python3", "-m", VLLM_API_MODULE]
ACCEPT_POLL_S = 0.5


def engine(timeout: int | None = 120) -> docker.DockerClient:
    """The Docker engine named by DOCKER_HOST (else the local socket), or a ServerError;
    ``timeout=None`` for a connection that waits as long as a container runs."""
    try:
        return docker.from_env(timeout=timeout)
    except docker.errors.DockerException as err:
        where = os.environ.get("DOCKER_HOST") or "the local socket /var/run/docker.sock"
        raise ServerError(
            f"server.runtime=docker, but no Docker engine answers at {where} ({err}); start "
            "Docker (in compose, mount /var/run/docker.sock into the pipeline service), or set "
            "server.runtime=process to run vLLM as a child process"
        ) from None


def remove_orphans(client: docker.DockerClient, run_name: str) -> list[str]:
    """Remove this run's server containers whose owner process is gone; their names."""
    removed = []
    for c in client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_name}"}):
        if owner_alive(c.labels.get(LABEL_OWNER, "")):
            continue
        log.warning("removing server container %s left behind by a killed run", c.name)
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)
        removed.append(c.name)
    return removed


def device_requests(gpus: str | list[str]) -> list[DeviceRequest]:
    if gpus == "none":
        return []
    if gpus == "all":
        return [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return [DeviceRequest(device_ids=list(gpus), capabilities=[["gpu"]])]


def mounts_and_hf_home(profile: Profile, model: str) -> tuple[list[str], str]:
    """Bind mounts for the container, and HF_HOME inside it.

    Given ``server.container.mounts`` they are used as written. Otherwise the run folder, a
    verifier on disk and the HF cache are mounted at the same paths as here, so every path in
    vLLM's arguments (the model, the connector's shard folder) means the same file inside.
    """
    c = profile.server.container
    if c.mounts is not None:
        return list(c.mounts), c.hf_home
    hf_home = str(Path(hub_constants.HF_HOME).resolve())
    paths = {str(profile.run.output_dir.resolve()), hf_home}
    if looks_like_path(model):
        paths.add(str(Path(model).resolve()))
    return [f"{p}:{p}" for p in sorted(paths)], hf_home


def container_name(profile: Profile, log_path: Path) -> str:
    stem = "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in log_path.stem)
    return f"eagle3-{profile.run.name}-{stem}-{os.getpid()}"


class Lifeline:
    """A loopback port where this process accepts the server guard's connection and holds it:
    the kernel closes it when this process ends, however it ends."""

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(ACCEPT_POLL_S)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="lifeline", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                self._held.append(self._listener.accept()[0])

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join()  # a close does not interrupt an accept() under way
        for s in (self._listener, *self._held):
            s.close()


def guarded_entrypoint(lifeline: Lifeline, stop_timeout_s: int) -> list[str]:
    """vLLM under the server guard, which leaves it the last seconds of the engine's stop
    timeout before the engine's SIGKILL."""
    grace_s = max(stop_timeout_s - 5, 1)
    guard = ["python3", "-m", GUARD_MODULE, "--lifeline", lifeline.address]
    return [*guard, "--grace-s", str(grace_s), "--", *VLLM_COMMAND]


def create_kwargs(
    profile: Profile, model: str, args: list[str], log_path: Path, lifeline: Lifeline
) -> dict[str, Any]:
    """The container the docker SDK creates for a stage's server."""
    c = profile.server.container
    mounts, hf_home = mounts_and_hf_home(profile, model)
    env = vllm_env(profile) | {
        "HF_HOME": hf_home,
        "HOME": "/tmp",  # the image's home belongs to its own user, not to --user
        "VLLM_CACHE_ROOT": f"{hf_home}/vllm",  # compiled graphs outlive the container
    }
    return {
        "name": container_name(profile, log_path),
        "entrypoint": guarded_entrypoint(lifeline, c.stop_timeout_s),
        "command": args,
        "environment": env,
        "labels": {LABEL_RUN: profile.run.name, LABEL_OWNER: owner_id()},
        "user": f"{os.getuid()}:{os.getgid()}",
        "network_mode": "host",
        "ipc_mode": "host",
        "volumes": mounts,
        # Same-path mounts: relative paths in vLLM's arguments resolve as they do here.
        "working_dir": os.getcwd() if c.mounts is None else None,
        "device_requests": device_requests(c.gpus) or None,
        "auto_remove": True,
    }


def _create(client: docker.DockerClient, c: ContainerConfig, **kwargs: Any) -> Container:
    try:
        return client.containers.create(c.image, **kwargs)
    except docker.errors.ImageNotFound:
        raise ServerError(
            f"Docker image {c.image!r} is not on this engine: build it with `make image` "
            "(VARIANT=cpu without GPUs), or set server.container.image"
        ) from None
    except docker.errors.APIError as err:
        raise ServerError(f"the Docker engine refused the server container: {err}") from None


def _start(container: Container, c: ContainerConfig) -> None:
    try:
        container.start()
    except docker.errors.APIError as err:
        hint = (
            "; without GPUs (or the NVIDIA container toolkit) set server.container.gpus=none"
            if c.gpus != "none"
            else ""
        )
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)  # created, never started: auto-remove does not apply
        raise ServerError(
            f"the Docker engine could not start {container.name}: {err}{hint}"
        ) from None


class _Watch:
    """The container's output, followed into the stage's log file from before it starts, and
    its exit status once it exits (the engine then removes it)."""

    def __init__(self, client: docker.DockerClient, container: Container, log_path: Path):
        self.name, self.status = container.name, None
        self.done = threading.Event()
        # Attached before the start, as `docker run` does: no line is missed, however soon
        # the container exits and is removed.
        stream = client.api.attach(container.id, stdout=True, stderr=True, stream=True, logs=True)
        self._follow = threading.Thread(target=self._copy, args=(stream, log_path), daemon=True)
        self._wait = threading.Thread(target=self._exit_status, args=(client, container.id))
        self._wait.daemon = True
        self._follow.start()
        self._wait.start()

    def _copy(self, stream: Iterator[bytes], log_path: Path) -> None:
        with open(log_path, "ab") as out, contextlib.suppress(Exception):
            for chunk in stream:
                out.write(chunk)
                out.flush()

    def _exit_status(self, client: docker.DockerClient, cid: str) -> None:
        try:
            self.status = client.api.wait(cid, condition="removed")["StatusCode"]
        except docker.errors.APIError:
            pass  # removed before the wait began: it exited, the status is lost
        finally:
            self.done.set()

    def exited(self) -> str | None:
        if not self.done.is_set():
            return None
        self._follow.join(timeout=5)  # the log's last lines, for the caller's quote
        status = "an unknown status" if self.status is None else f"status {self.status}"
        return f"vLLM's container {self.name} exited with {status}"

    def join(self, timeout_s: float) -> None:
        self._wait.join(timeout_s)
        self._follow.join(timeout=5)


def _teardown(container: Container, watch: _Watch | None, stop_timeout_s: int) -> None:
    """Stop (SIGTERM, then SIGKILL after the timeout): the engine removes it; its log is whole."""
    try:
        container.stop(timeout=stop_timeout_s)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as err:
        log.warning("stopping %s: %s; removing it by force", container.name, err)
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)
    if watch is not None:
        watch.join(stop_timeout_s + 10)


@contextlib.contextmanager
def container_server(
    profile: Profile, model: str, args: list[str], base_url: str, log_path: Path
) -> Iterator[Container]:
    """A running, healthy vLLM container serving ``args`` at ``base_url``; always removed."""
    c = profile.server.container
    client, waiting = engine(), engine(timeout=None)
    lifeline = Lifeline(profile.server.host)
    try:
        remove_orphans(client, profile.run.name)
        kwargs = create_kwargs(profile, model, args, log_path, lifeline)
        container = _create(client, c, **kwargs)
        watch = None
        try:
            watch = _Watch(waiting, container, log_path)
            log.info(
                "starting vLLM in container %s (%s): %s; follow it with `docker logs -f %s`",
                container.name,
                c.image,
                " ".join(args),
                container.name,
            )
            _start(container, c)
            wait_until_healthy(base_url, profile.server.startup_timeout_s, watch.exited, log_path)
            yield container
        finally:
            _teardown(container, watch, c.stop_timeout_s)
    finally:
        lifeline.close()
        client.close()
        waiting.close()
