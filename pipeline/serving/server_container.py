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
- it is stopped and removed when the ``with`` block ends, on success, error and Ctrl-C, after
  its log is written to the stage's log file; a container of the same run left behind by a
  process that was killed is removed before the next one starts;
- an unreachable engine, a missing image, a container that exits while loading or never
  becomes healthy raise :class:`~pipeline.serving.vllm_server.ServerError` naming it and the fix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import DeviceRequest
from huggingface_hub import constants as hub_constants

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import ContainerConfig, Profile
from pipeline.core.model_names import looks_like_path
from pipeline.serving.server_guard import owner_alive, owner_id
from pipeline.serving.vllm_api import VLLM_API_MODULE, ServerError, vllm_env, wait_until_healthy

log = logging.getLogger(__name__)
LABEL_RUN = "eagle3-release.run"
LABEL_OWNER = "eagle3-release.owner"
ENTRYPOINT = ["python3", "-m", VLLM_API_MODULE]
LOG_REFRESH_S = 5.0


def engine() -> docker.DockerClient:
    """The Docker engine named by DOCKER_HOST (else the local socket), or a ServerError."""
    try:
        return docker.from_env(timeout=120)
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


def _create(client: docker.DockerClient, c: ContainerConfig, **kwargs) -> Container:
    try:
        return client.containers.create(c.image, **kwargs)
    except docker.errors.ImageNotFound:
        raise ServerError(
            f"Docker image {c.image!r} is not on this engine: build it with "
            "`docker compose build` (or set server.container.image)"
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
        raise ServerError(
            f"the Docker engine could not start {container.name}: {err}{hint}"
        ) from None


class _LogMirror:
    """Copies the container's log into the stage's log file, at most every LOG_REFRESH_S."""

    def __init__(self, container: Container, log_path: Path) -> None:
        self.container, self.log_path, self.saved_at = container, log_path, float("-inf")

    def save(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.saved_at < LOG_REFRESH_S:
            return
        with contextlib.suppress(docker.errors.APIError):
            atomic_write_bytes(self.log_path, self.container.logs(stdout=True, stderr=True))
            self.saved_at = time.monotonic()


def _exited(container: Container, mirror: _LogMirror) -> Callable[[], str | None]:
    def why() -> str | None:
        container.reload()
        gone = container.status in ("exited", "dead")
        mirror.save(force=gone)
        if not gone:
            return None
        code = container.attrs.get("State", {}).get("ExitCode")
        return f"vLLM's container {container.name} exited with status {code}"

    return why


def _teardown(container: Container, mirror: _LogMirror, stop_timeout_s: int) -> None:
    """Stop (SIGTERM, then SIGKILL after the timeout), keep the whole log, remove."""
    try:
        container.stop(timeout=stop_timeout_s)
    except docker.errors.NotFound:
        return
    except docker.errors.APIError as err:
        log.warning("stopping %s: %s; removing it by force", container.name, err)
    mirror.save(force=True)
    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True)


@contextlib.contextmanager
def container_server(
    profile: Profile, model: str, args: list[str], base_url: str, log_path: Path
) -> Iterator[Container]:
    """A running, healthy vLLM container serving ``args`` at ``base_url``; always removed."""
    c = profile.server.container
    client = engine()
    try:
        remove_orphans(client, profile.run.name)
        mounts, hf_home = mounts_and_hf_home(profile, model)
        env = vllm_env(profile) | {
            "HF_HOME": hf_home,
            "HOME": "/tmp",  # the image's home belongs to its own user, not to --user
            "VLLM_CACHE_ROOT": f"{hf_home}/vllm",  # compiled graphs outlive the container
        }
        name = container_name(profile, log_path)
        container = _create(
            client,
            c,
            name=name,
            entrypoint=ENTRYPOINT,
            command=args,
            environment=env,
            labels={LABEL_RUN: profile.run.name, LABEL_OWNER: owner_id()},
            user=f"{os.getuid()}:{os.getgid()}",
            network_mode="host",
            ipc_mode="host",
            volumes=mounts,
            # Same-path mounts: relative paths in vLLM's arguments resolve as they do here.
            working_dir=os.getcwd() if c.mounts is None else None,
            device_requests=device_requests(c.gpus) or None,
        )
        mirror = _LogMirror(container, log_path)
        try:
            log.info(
                "starting vLLM in container %s (%s): %s; follow it with `docker logs -f %s`",
                name,
                c.image,
                " ".join(args),
                name,
            )
            _start(container, c)
            wait_until_healthy(
                base_url, profile.server.startup_timeout_s, _exited(container, mirror), log_path
            )
            yield container
        finally:
            _teardown(container, mirror, c.stop_timeout_s)
    finally:
        client.close()
