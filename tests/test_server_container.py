"""server.runtime=docker: stages' vLLM servers as containers, through the real docker SDK
client against a stand-in Engine API on a unix socket (tests/fake_docker_engine.py).

The "containers" are local processes of a vLLM stand-in (tests/stub_vllm.py), so what is
tested is the driver: what it asks the engine for (image, entrypoint, vLLM's arguments, GPUs,
host network on loopback, mounts, user, labels, no token), health waiting, and that the
container is stopped and removed however the block ends.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from pipeline.core.config import ConfigError, load_profile
from pipeline.serving import server_container
from pipeline.serving.server_container import ENTRYPOINT, LABEL_OWNER, LABEL_RUN, owner_id
from pipeline.serving.vllm_api import ServerError
from pipeline.serving.vllm_server import vllm_server
from tests.fake_docker_engine import FakeDockerEngine, Image

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
SECRET = "hf_never_in_a_container_0123456789"


def stub_image(mode: str) -> Image:
    def argv(cmd: list[str]) -> list[str]:
        assert cmd[:3] == ENTRYPOINT, cmd
        return [sys.executable, "-m", "tests.stub_vllm", "--mode", mode, *cmd[3:]]

    return Image(argv=argv, env={"PYTHONPATH": str(REPO)})


@pytest.fixture
def engine(tmp_path, monkeypatch):
    images = {f"stub-vllm:{m}": stub_image(m) for m in ("ok", "crash", "hang")}
    with FakeDockerEngine(tmp_path / "engine.sock", images) as fake:
        monkeypatch.setenv("DOCKER_HOST", fake.docker_host)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        monkeypatch.setattr(server_container, "LOG_REFRESH_S", 0.2)
        yield fake


def docker_profile(tmp_path: Path, *overrides: str):
    return load_profile(
        REPO / "configs" / "tiny.yaml",
        [
            f"run.output_dir={tmp_path / 'runs'}",
            "server.runtime=docker",
            "server.container.image=stub-vllm:ok",
            "server.startup_timeout_s=60",
            *overrides,
        ],
    )


def created(engine: FakeDockerEngine) -> dict:
    (body,) = engine.bodies("/containers/create")
    return body


def serve_once(profile, log_path: Path) -> None:
    with vllm_server(profile, "m", log_path):
        pass


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_server_runs_as_a_container_on_loopback_and_is_removed_after(engine, tmp_path):
    profile = docker_profile(tmp_path)
    log_path = tmp_path / "stage" / "vllm.log"
    model = str(tmp_path / "model")
    with vllm_server(profile, model, log_path) as endpoint:
        assert endpoint.base_url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{endpoint.base_url}/health").status_code == 200
        assert endpoint.container in {c.name for c in engine.containers.values()}

    body = created(engine)
    assert body["Image"] == "stub-vllm:ok"
    assert body["Entrypoint"] == ENTRYPOINT
    cmd = body["Cmd"]
    assert flag(cmd, "--model") == model
    assert flag(cmd, "--host") == "127.0.0.1"
    assert f"http://127.0.0.1:{flag(cmd, '--port')}" == endpoint.base_url
    host = body["HostConfig"]
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host"
    assert host["DeviceRequests"] == [
        {"Driver": "", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    out = str((tmp_path / "runs").resolve())
    assert f"{out}:{out}" in host["Binds"]
    assert f"{Path(model).resolve()}:{Path(model).resolve()}" in host["Binds"]
    env = dict(item.split("=", 1) for item in body["Env"])
    assert env["VLLM_HOST_IP"] == env["VLLM_LOOPBACK_IP"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1"  # the tiny verifier is on disk
    assert body["User"] == f"{os.getuid()}:{os.getgid()}"
    assert body["WorkingDir"] == os.getcwd()  # relative paths mean the same files inside
    assert body["Labels"] == {LABEL_RUN: "tiny", LABEL_OWNER: owner_id()}
    # The token in this environment reaches no request to the engine.
    assert not any(SECRET in raw for _, _, raw in engine.requests)

    assert engine.containers == {}
    log = log_path.read_text()
    assert "stub vllm: mode=ok host=127.0.0.1" in log
    assert "stopped by SIGTERM" in log


def test_the_container_is_removed_when_the_stage_fails(engine, tmp_path):
    profile = docker_profile(tmp_path)
    with (
        pytest.raises(RuntimeError, match="stage failed"),
        vllm_server(profile, "m", tmp_path / "vllm.log"),
    ):
        raise RuntimeError("stage failed")
    assert engine.containers == {}


def test_a_container_that_exits_while_loading_names_itself_and_its_log(engine, tmp_path):
    profile = docker_profile(tmp_path, "server.container.image=stub-vllm:crash")
    log_path = tmp_path / "vllm.log"
    with pytest.raises(ServerError) as err:
        serve_once(profile, log_path)
    message = str(err.value)
    assert "container eagle3-tiny-vllm-" in message and "exited with status 3" in message
    assert "the model does not fit (on purpose)" in message  # the container's log tail
    assert str(log_path) in message
    assert engine.containers == {}


def test_a_container_that_never_answers_times_out_and_is_removed(engine, tmp_path):
    profile = docker_profile(
        tmp_path, "server.container.image=stub-vllm:hang", "server.startup_timeout_s=3"
    )
    with pytest.raises(ServerError, match=r"not healthy after 3s; raise server\.startup_timeout_s"):
        serve_once(profile, tmp_path / "vllm.log")
    assert engine.containers == {}


def test_a_missing_image_says_how_to_build_it(engine, tmp_path):
    profile = docker_profile(tmp_path, "server.container.image=eagle3-release:nope")
    with pytest.raises(ServerError, match=r"'eagle3-release:nope'.*docker compose build"):
        serve_once(profile, tmp_path / "vllm.log")
    assert engine.containers == {}


def test_no_engine_names_where_it_looked_and_the_alternatives(tmp_path, monkeypatch):
    sock = tmp_path / "nothing-here.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    with pytest.raises(ServerError) as err:
        serve_once(docker_profile(tmp_path), tmp_path / "vllm.log")
    assert str(sock) in str(err.value)
    assert "server.runtime=process" in str(err.value)


def test_a_container_left_by_a_killed_run_is_removed_first(engine, tmp_path):
    dead = f"{owner_id().split(':')[0]}:999999999:0"  # no such process on this host
    engine.add_container("eagle3-tiny-left-behind", {LABEL_RUN: "tiny", LABEL_OWNER: dead})
    engine.add_container("eagle3-tiny-live", {LABEL_RUN: "tiny", LABEL_OWNER: owner_id()})
    engine.add_container("eagle3-other-run", {LABEL_RUN: "other", LABEL_OWNER: dead})
    with vllm_server(docker_profile(tmp_path), "m", tmp_path / "vllm.log"):
        names = {c.name for c in engine.containers.values()}
        assert "eagle3-tiny-left-behind" not in names
        assert {"eagle3-tiny-live", "eagle3-other-run"} <= names


@pytest.mark.parametrize(
    ("gpus", "requests"),
    [
        ("none", None),
        (
            "[0,3]",
            [
                {
                    "Driver": "",
                    "Count": 0,
                    "DeviceIDs": ["0", "3"],
                    "Capabilities": [["gpu"]],
                    "Options": {},
                }
            ],
        ),
    ],
)
def test_gpu_reservations_follow_the_profile(engine, tmp_path, gpus, requests):
    profile = docker_profile(tmp_path, f"server.container.gpus={gpus}")
    serve_once(profile, tmp_path / "vllm.log")
    assert created(engine)["HostConfig"].get("DeviceRequests") == requests


def test_explicit_mounts_replace_the_same_path_ones(engine, tmp_path):
    profile = docker_profile(
        tmp_path, "server.container.mounts=[/srv/data:/data, /srv/hf:/hf-cache:ro]"
    )
    serve_once(profile, tmp_path / "vllm.log")
    body = created(engine)
    assert body["HostConfig"]["Binds"] == ["/srv/data:/data", "/srv/hf:/hf-cache:ro"]
    assert body.get("WorkingDir") is None  # the image's own
    env = dict(item.split("=", 1) for item in body["Env"])
    assert env["HF_HOME"] == "/hf-cache" and env["VLLM_CACHE_ROOT"] == "/hf-cache/vllm"


def test_a_malformed_mount_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'/srv/data' must look like /host/path:/container"):
        docker_profile(tmp_path, "server.container.mounts=[/srv/data]")
