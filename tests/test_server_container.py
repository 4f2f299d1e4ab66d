"""server.runtime=docker: stages' vLLM servers as containers through the docker SDK, against the
real Docker engine that `make test` starts (tests/docker_engine.py).

The server image here is the CPU release image with a stand-in for vLLM's server module first
on its import path (tests/stub_vllm.py: serves /health, or exits while loading, or never
answers), so what runs for real is everything else: the engine, the image's Python, the
server guard as the container's first process, the docker SDK driver under test. GPU device
requests are checked as the engine records them at create time: a CPU engine cannot start them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import docker.errors
import httpx
import pytest

from pipeline.core.config import ConfigError, load_profile
from pipeline.serving.server_container import (
    LABEL_OWNER,
    LABEL_RUN,
    VLLM_COMMAND,
    Lifeline,
    create_kwargs,
    owner_id,
)
from pipeline.serving.vllm_api import ServerError
from pipeline.serving.vllm_server import vllm_server
from tests.docker_engine import CPU_IMAGE

REPO = Path(__file__).parent.parent
SECRET = "hf_never_in_a_container_0123456789"
RUN = "sdk-test"  # its own run name: this test's containers are told apart from any other's
STUB_API_SERVER = """
import os, sys
from tests.stub_vllm import main
sys.argv[1:1] = ["--mode", os.environ["STUB_VLLM_MODE"]]
main()
"""
STUB_DOCKERFILE = f"""
FROM {CPU_IMAGE}
COPY stub /stub
ARG MODE
ENV PYTHONPATH=/stub:/app STUB_VLLM_MODE=$MODE
"""


@pytest.fixture(scope="module")
def stub_images(docker_engine, tmp_path_factory):
    """``stub-vllm:ok|crash|hang``: the CPU image whose vLLM server module is the stand-in."""
    context = tmp_path_factory.mktemp("stub-image")
    package = context / "stub" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").touch()
    (package / "api_server.py").write_text(STUB_API_SERVER)
    (context / "stub" / "tests").mkdir()
    (context / "stub" / "tests" / "__init__.py").touch()
    shutil.copy(REPO / "tests" / "stub_vllm.py", context / "stub" / "tests")
    (context / "Dockerfile").write_text(STUB_DOCKERFILE)
    for mode in ("ok", "crash", "hang"):
        docker_engine.images.build(
            path=str(context), tag=f"stub-vllm:{mode}", buildargs={"MODE": mode}, rm=True
        )
    yield
    for mode in ("ok", "crash", "hang"):
        docker_engine.images.remove(f"stub-vllm:{mode}", force=True)


@pytest.fixture
def engine(docker_engine, stub_images, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    yield docker_engine
    left = run_containers(docker_engine)
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.name for c in left]}"


def docker_overrides(tmp_path: Path) -> list[str]:
    """This test's run, its servers as stand-in containers without GPUs."""
    return [
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.name={RUN}",
        "server.runtime=docker",
        "server.container.image=stub-vllm:ok",
        "server.container.gpus=none",
        "server.container.stop_timeout_s=10",
    ]


def docker_profile(tmp_path: Path, *overrides: str):
    return load_profile(
        REPO / "configs" / "tiny.yaml",
        [*docker_overrides(tmp_path), "server.startup_timeout_s=60", *overrides],
    )


def serve_once(profile, log_path: Path) -> None:
    with vllm_server(profile, "m", log_path):
        pass


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def run_containers(client: docker.DockerClient, run: str = RUN) -> list:
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run}"})


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.5)


@pytest.mark.containers
def test_the_server_runs_as_a_container_on_loopback_and_is_removed_after(engine, tmp_path):
    profile = docker_profile(tmp_path)
    log_path = tmp_path / "stage" / "vllm.log"
    model = str(tmp_path / "model")
    with vllm_server(profile, model, log_path) as endpoint:
        assert endpoint.base_url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{endpoint.base_url}/health").status_code == 200
        attrs = engine.containers.get(endpoint.container).attrs

    config, host = attrs["Config"], attrs["HostConfig"]
    assert config["Image"] == "stub-vllm:ok"
    entry = config["Entrypoint"]
    assert entry[:3] == ["python3", "-m", "pipeline.serving.server_guard"]
    assert entry[entry.index("--") + 1 :] == VLLM_COMMAND
    assert flag(entry, "--lifeline").startswith("127.0.0.1:")
    cmd = config["Cmd"]
    assert flag(cmd, "--model") == model
    assert flag(cmd, "--host") == "127.0.0.1"
    assert f"http://127.0.0.1:{flag(cmd, '--port')}" == endpoint.base_url
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host"
    assert host["AutoRemove"] is True
    assert not host.get("DeviceRequests")
    out = str((tmp_path / "runs").resolve())
    assert f"{out}:{out}" in host["Binds"]
    assert f"{Path(model).resolve()}:{Path(model).resolve()}" in host["Binds"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["VLLM_HOST_IP"] == env["VLLM_LOOPBACK_IP"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1"  # the tiny verifier is on disk
    assert not any(SECRET in item for item in config["Env"])  # the token stays here
    assert config["User"] == f"{os.getuid()}:{os.getgid()}"
    assert config["WorkingDir"] == os.getcwd()  # relative paths mean the same files inside
    assert config["Labels"][LABEL_RUN] == RUN
    assert config["Labels"][LABEL_OWNER] == owner_id()

    assert run_containers(engine) == []
    log = log_path.read_text()
    assert f"stub vllm: mode=ok host=127.0.0.1 port={flag(cmd, '--port')} uid={os.getuid()}" in log
    assert "stopped by SIGTERM" in log  # stopped, not killed: its log is whole


@pytest.mark.containers
def test_the_container_is_removed_when_the_stage_fails(engine, tmp_path):
    profile = docker_profile(tmp_path)
    with (
        pytest.raises(RuntimeError, match="stage failed"),
        vllm_server(profile, "m", tmp_path / "vllm.log"),
    ):
        raise RuntimeError("stage failed")
    assert run_containers(engine) == []


@pytest.mark.containers
def test_a_container_that_exits_while_loading_names_itself_and_its_log(engine, tmp_path):
    profile = docker_profile(tmp_path, "server.container.image=stub-vllm:crash")
    log_path = tmp_path / "vllm.log"
    with pytest.raises(ServerError) as err:
        serve_once(profile, log_path)
    message = str(err.value)
    assert f"container eagle3-{RUN}-vllm-" in message and "exited with status 3" in message
    assert "the model does not fit (on purpose)" in message  # the container's log tail
    assert str(log_path) in message
    assert run_containers(engine) == []


@pytest.mark.containers
@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("server.container.image=stub-vllm:hang", r"not healthy after 5s; raise server\.start"),
        ("server.container.image=eagle3-release:nope", r"'eagle3-release:nope'.*make image"),
        # A CPU engine cannot start GPU device requests: what a host without the toolkit says.
        ("server.container.gpus=all", r"could not start .*set server\.container\.gpus=none"),
    ],
)
def test_a_server_that_cannot_come_up_says_why_and_leaves_nothing(engine, tmp_path, override, why):
    profile = docker_profile(tmp_path, override, "server.startup_timeout_s=5")
    with pytest.raises(ServerError, match=why):
        serve_once(profile, tmp_path / "vllm.log")
    assert run_containers(engine) == []


# A stage (run as every stage is, through cli.report): starts its server through vllm_server,
# says which container, and waits to be killed.
STAGE = """
import sys, time
from pathlib import Path
from pipeline.core.cli import report
from pipeline.core.config import load_profile
from pipeline.serving.vllm_server import vllm_server
def body():
    profile = load_profile("configs/tiny.yaml", sys.argv[2:])
    with vllm_server(profile, "m", Path(sys.argv[1])) as endpoint:
        print(endpoint.container, flush=True)
        time.sleep(600)
report(body)
"""


@pytest.mark.containers
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_the_container_dies_with_a_killed_stage(engine, tmp_path, sig):
    """SIGTERM unwinds the stage (its ``finally`` stops the container); SIGKILL skips every
    ``finally``, and the guard in the container sees the lifeline close."""
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE, str(tmp_path / "vllm.log"), *docker_overrides(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        name = stage.stdout.readline().strip()
        assert name.startswith(f"eagle3-{RUN}-vllm-"), name
        assert engine.containers.get(name).status == "running"
        stage.send_signal(getattr(signal, sig))
        assert stage.wait(timeout=30) == (128 + signal.SIGTERM if sig == "SIGTERM" else -9)
    finally:
        stage.kill()
    wait_for(lambda: run_containers(engine) == [], 30, f"{name} gone after the stage's {sig}")
    if sig == "SIGTERM":  # the stage's own teardown ran, following the log to its end
        assert "stopped by SIGTERM" in (tmp_path / "vllm.log").read_text()


@pytest.mark.containers
def test_a_container_left_by_a_killed_run_is_removed_first(engine, tmp_path):
    dead = f"{owner_id().split(':')[0]}:999999999:0"  # no such process on this host
    sleeper = {"command": ["sleep", "600"], "detach": True, "entrypoint": []}
    left = [
        (f"eagle3-{RUN}-left-behind", {LABEL_RUN: RUN, LABEL_OWNER: dead}),
        (f"eagle3-{RUN}-live", {LABEL_RUN: RUN, LABEL_OWNER: owner_id()}),
        ("eagle3-other-run", {LABEL_RUN: "other", LABEL_OWNER: dead}),
    ]
    for name, labels in left:
        engine.containers.run(CPU_IMAGE, name=name, labels=labels, **sleeper)
    try:
        with vllm_server(docker_profile(tmp_path), "m", tmp_path / "vllm.log"):
            names = {c.name for c in engine.containers.list(all=True)}
            assert f"eagle3-{RUN}-left-behind" not in names
            assert {f"eagle3-{RUN}-live", "eagle3-other-run"} <= names
    finally:
        for name, _ in left[1:]:
            engine.containers.get(name).remove(force=True)


@pytest.mark.containers
@pytest.mark.parametrize(
    ("gpus", "requests"),
    [
        ("none", None),  # recorded as no requests at all
        ("all", [{"Driver": "", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]]}]),
        ("[0,3]", [{"Driver": "", "Count": 0, "DeviceIDs": ["0", "3"], "Capabilities": [["gpu"]]}]),
    ],
)
def test_gpu_reservations_follow_the_profile(engine, tmp_path, gpus, requests):
    """As the engine records them at create time; only a GPU host can start them."""
    profile = docker_profile(tmp_path, f"server.container.gpus={gpus}")
    lifeline = Lifeline("127.0.0.1")
    kwargs = create_kwargs(profile, "m", ["--host", "127.0.0.1"], tmp_path / "x.log", lifeline)
    container = engine.containers.create("stub-vllm:ok", **kwargs)
    try:
        keys = ("Driver", "Count", "DeviceIDs", "Capabilities")
        recorded = container.attrs["HostConfig"].get("DeviceRequests") or []
        assert ([{k: r[k] for k in keys} for r in recorded] or None) == requests
    finally:
        container.remove(force=True)
        lifeline.close()


@pytest.mark.containers
def test_explicit_mounts_replace_the_same_path_ones(engine, tmp_path):
    data, hf = tmp_path / "data", tmp_path / "hf"
    data.mkdir(), hf.mkdir()
    profile = docker_profile(tmp_path, f"server.container.mounts=[{data}:/data, {hf}:/hf-cache:ro]")
    with vllm_server(profile, "m", tmp_path / "vllm.log") as endpoint:
        attrs = engine.containers.get(endpoint.container).attrs
    assert attrs["HostConfig"]["Binds"] == [f"{data}:/data", f"{hf}:/hf-cache:ro"]
    assert attrs["Config"]["WorkingDir"] == "/app"  # the image's own
    env = dict(item.split("=", 1) for item in attrs["Config"]["Env"])
    assert env["HF_HOME"] == "/hf-cache" and env["VLLM_CACHE_ROOT"] == "/hf-cache/vllm"


@pytest.mark.unit
def test_no_engine_names_where_it_looked_and_the_alternatives(tmp_path, monkeypatch):
    sock = tmp_path / "nothing-here.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    with pytest.raises(ServerError) as err:
        serve_once(docker_profile(tmp_path), tmp_path / "vllm.log")
    assert str(sock) in str(err.value)
    assert "server.runtime=process" in str(err.value)


@pytest.mark.unit
def test_a_malformed_mount_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'/srv/data' must look like /host/path:/container"):
        docker_profile(tmp_path, "server.container.mounts=[/srv/data]")


@pytest.mark.unit
def test_the_lifeline_closes_with_its_owner():
    """What the guard in a container watches: EOF once the owner's side is closed."""
    from pipeline.serving.server_guard import lifeline

    line = Lifeline("127.0.0.1")
    held = lifeline(line.address)
    wait_for(lambda: line._held, 5, "the connection accepted")
    assert held()
    line.close()
    wait_for(lambda: not held(), 5, "EOF seen")
    assert not lifeline(line.address)()  # nobody listens any more: gone already
