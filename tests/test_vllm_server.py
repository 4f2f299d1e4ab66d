"""Server lifecycle: loopback only, clear errors for a dead or failing server, always stopped,
also when the stage that started it is killed."""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pipeline.core.config import load_profile
from pipeline.serving.server_guard import guarded, owner_id, process_start
from pipeline.serving.vllm_api import ServerError, free_port, server_command
from pipeline.serving.vllm_server import SERVERS, vllm_server
from tests.helpers import alive_after

REPO = Path(__file__).parent.parent


@pytest.mark.unit
def test_command_binds_loopback_and_carries_the_profile():
    profile = load_profile("configs/kimi-k2.5.yaml")
    cmd = server_command(profile, "moonshotai/Kimi-K2.5", 8000, platform="cuda")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "auto"
    assert "--trust-remote-code" in cmd and "--enforce-eager" not in cmd
    assert cmd[cmd.index("--reasoning-parser") + 1] == "kimi_k2"


@pytest.mark.unit
def test_dead_base_url_gives_a_clear_error(tmp_path):
    port = free_port()
    profile = load_profile(
        "configs/tiny.yaml",
        [f"server.base_url=http://127.0.0.1:{port}/v1", "server.startup_timeout_s=2"],
    )
    with (
        pytest.raises(ServerError, match=r"not healthy after 2s; raise server.startup_timeout_s"),
        vllm_server(profile, "unused", tmp_path / "log"),
    ):
        pass


@pytest.mark.e2e
def test_a_server_that_fails_to_load_reports_its_log_and_is_gone(tmp_path):
    profile = load_profile("configs/tiny.yaml", ["server.startup_timeout_s=300"])
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    with (
        pytest.raises(ServerError, match="vLLM exited with status") as err,
        vllm_server(profile, str(missing), tmp_path / "vllm.log"),
    ):
        pass
    assert str(tmp_path / "vllm.log") in str(err.value)


# A stand-in for vLLM's server module, first on the server's import path: tests/stub_vllm.py with
# two "engine" workers, one in the server's process group and one that left it, as vLLM's own
# engine and worker processes are the stage's grandchildren.
FAKE_API_SERVER = """
import os, subprocess, sys
from tests.stub_vllm import main
worker = [sys.executable, "-c", "import time; time.sleep(600)"]
workers = [subprocess.Popen(worker), subprocess.Popen(worker, start_new_session=True)]
print("stub vllm: workers", *(w.pid for w in workers), flush=True)
sys.argv[1:1] = ["--mode", os.environ.get("STUB_VLLM_MODE", "ok")]
main()
"""

# A stage: starts its server through vllm_server, says where it is, and waits to be killed.
STAGE = """
import sys, time
from pipeline.core.config import load_profile
from pipeline.serving.vllm_server import vllm_server
profile = load_profile("configs/tiny.yaml", sys.argv[2:])
with vllm_server(profile, "m", __import__("pathlib").Path(sys.argv[1])) as endpoint:
    print(endpoint.pid, flush=True)
    time.sleep(600)
"""


@pytest.fixture
def stub_vllm(tmp_path, monkeypatch):
    """Servers started by vllm_server in this test are the stand-in; yields their profile."""
    package = tmp_path / "fake-vllm" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").touch()
    (package / "api_server.py").write_text(FAKE_API_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake-vllm"))
    return load_profile(
        REPO / "configs" / "tiny.yaml",
        [f"run.output_dir={tmp_path / 'runs'}", "server.startup_timeout_s=60"],
    )


def server_processes(log_path: Path, guard: int) -> list[psutil.Process]:
    """The guard, the server and both workers (their pids from the server's log)."""
    line = next(x for x in log_path.read_text().splitlines() if x.startswith("stub vllm: workers"))
    procs = [psutil.Process(pid) for pid in [guard, *(int(p) for p in line.split()[3:])]]
    return list({p.pid: p for p in [*procs, *procs[0].children(recursive=True)]}.values())


@pytest.mark.unit
def test_a_server_and_its_workers_die_with_a_sigkilled_stage(stub_vllm, tmp_path):
    log_path = tmp_path / "vllm.log"
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE, str(log_path), f"run.output_dir={tmp_path / 'runs'}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ['PYTHONPATH']}"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        guard = int(stage.stdout.readline())
        procs = server_processes(log_path, guard)
        assert len(procs) >= 3 and all(p.is_running() for p in procs)
        stage.kill()
        stage.wait(timeout=10)
        assert alive_after(procs, 5) == []
    finally:
        stage.kill()
    assert "server_guard: the stage is gone" in log_path.read_text()


@pytest.mark.unit
def test_the_guard_reports_the_servers_exit_and_a_stop_waits_for_it(stub_vllm, tmp_path):
    with (
        pytest.raises(ServerError, match=r"vLLM exited with status 3 while loading"),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("STUB_VLLM_MODE", "crash")
        with vllm_server(stub_vllm, "m", tmp_path / "crash.log"):
            pass
    with vllm_server(stub_vllm, "m", tmp_path / "ok.log") as endpoint:
        procs = server_processes(tmp_path / "ok.log", endpoint.pid)
        assert httpx.get(f"{endpoint.v1}/models").json()["data"][0]["id"] == "verifier"
        records = list((stub_vllm.run.run_dir / SERVERS).glob("*.json"))
        assert [r.name for r in records] == [f"{endpoint.pid}.json"]
    assert alive_after(procs, 0) == []  # stopped before the block returned
    assert "stopped by SIGTERM" in (tmp_path / "ok.log").read_text()
    assert list((stub_vllm.run.run_dir / SERVERS).glob("*.json")) == []


@pytest.mark.unit
def test_the_next_start_reaps_a_server_group_whose_stage_is_gone(stub_vllm, tmp_path, caplog):
    servers = stub_vllm.run.run_dir / SERVERS
    servers.mkdir(parents=True)
    sleeper = [sys.executable, "-c", "import subprocess, sys, time; " + (
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    )]  # fmt: skip

    def left_behind(owner: str) -> psutil.Process:
        """A long-running process group recorded as a server of ``owner``."""
        leader = subprocess.Popen(sleeper, start_new_session=True)
        body = {"pgid": leader.pid, "start": process_start(leader.pid), "owner": owner, "log": "x"}
        (servers / f"{leader.pid}.json").write_text(json.dumps(body))
        return psutil.Process(leader.pid)

    dead_owner = f"{socket.gethostname()}:999999999:0"  # no such process on this host
    orphan, alive = left_behind(dead_owner), left_behind(owner_id())
    recycled = left_behind(dead_owner)  # the record names another start time of its pid
    body = json.loads((servers / f"{recycled.pid}.json").read_text())
    (servers / f"{recycled.pid}.json").write_text(json.dumps({**body, "start": "1"}))
    try:
        while len(orphan.children()) < 1:  # its worker is up
            time.sleep(0.05)
        group = [orphan, *orphan.children()]
        with caplog.at_level(logging.WARNING), vllm_server(stub_vllm, "m", tmp_path / "log"):
            assert alive_after(group, 0) == []  # reaped before the new server started
            assert alive.is_running() and recycled.is_running()
            assert not (servers / f"{orphan.pid}.json").exists()
            assert not (servers / f"{recycled.pid}.json").exists()
            assert (servers / f"{alive.pid}.json").exists()
        assert f"stopped vLLM server group {orphan.pid} left behind" in caplog.text
    finally:
        for p in (orphan, alive, recycled):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("exit_with", "status"),
    [("sys.exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL)],
)
def test_the_guard_exits_as_its_server_did(exit_with, status):
    server = [sys.executable, "-c", f"import os, signal, sys; {exit_with}"]
    guard = subprocess.Popen(guarded(server), cwd=REPO, start_new_session=True)
    assert guard.wait(timeout=30) == status
