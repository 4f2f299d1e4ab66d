"""Nothing the trainer's ranks open listens beyond loopback, watched as it happens.

The listener guard (tests/listener_guard.py) is tested on real sockets, then shown torchrun's
store on every interface (why the train stage does not use it), then set on the rank launcher
(pipeline.training.ranks): one node of two ranks and two "nodes" on this host, each rank a real
gloo process group that sums across ranks (tests/rank_probe.py); and a rank that fails stops
the rest, its status the launcher's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.serving.vllm_api import free_port
from pipeline.training.ranks import rank_env, store_endpoint
from tests.listener_guard import ListenerGuard, kill_tree, run_watched

REPO = Path(__file__).parent.parent
PROBE = "tests.rank_probe"


def launcher_command(store: str, nproc: int = 1, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "pipeline.training.ranks",
        "--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
        "--store", store, "-m", PROBE,
    ]  # fmt: skip


def rank_run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # TMPDIR: torch.distributed leaves folders there.
    return {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo",
            "TMPDIR": str(tmp_path), **extra}  # fmt: skip


@pytest.mark.unit
def test_the_guard_names_each_listener_beyond_loopback(tmp_path):
    script = (
        "import socket, time\n"
        "wide = socket.socket(); wide.bind(('0.0.0.0', 0)); wide.listen()\n"
        "near = socket.socket(); near.bind(('127.0.0.1', 0)); near.listen()\n"
        "print(wide.getsockname()[1], near.getsockname()[1], flush=True); time.sleep(0.6)\n"
    )
    proc, guard = run_watched([sys.executable, "-c", script], timeout=30)
    wide, near = map(int, proc.stdout.split())
    seen = {(listener.address, listener.port) for listener in guard.seen.values()}
    assert {("0.0.0.0", wide), ("127.0.0.1", near)} <= seen
    with pytest.raises(AssertionError) as failure:
        guard.check("the probe")
    message = str(failure.value)
    assert f"tcp 0.0.0.0:{wide} held by pid " in message and f"127.0.0.1:{near}" not in message
    assert "python" in message and "socket" in message  # the process, by its command line


@pytest.mark.unit
def test_the_guard_watches_a_tree_that_appears_later():
    """Roots are asked anew each sample: a container's first process, found once it exists."""
    found: list[int] = []
    with ListenerGuard(lambda: found) as guard:
        time.sleep(0.3)
        child = subprocess.Popen(
            [sys.executable, "-c", "import socket,time; s=socket.socket(); "
             "s.bind(('0.0.0.0', 0)); s.listen(); time.sleep(1.5)"],
        )  # fmt: skip
        found.append(child.pid)
        child.wait(timeout=30)
    assert guard.samples >= 4
    assert [listener.pid for listener in guard.beyond_loopback] == [child.pid]


@pytest.mark.unit
def test_store_endpoints_and_rank_variables():
    assert store_endpoint("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert store_endpoint("[fd00::1]:29500") == ("fd00::1", 29500)
    bad = ("localhost:29500", "127.0.0.1", "127.0.0.1:0", "10.0.0.1:70000", "fd00::1:29500",
           "[127.0.0.1]:29500")  # fmt: skip
    for value in bad:
        with pytest.raises(Exception, match="expected IP:PORT"):
            store_endpoint(value)
    for every in ("0.0.0.0:29500", "[::]:29500", "[::ffff:0.0.0.0]:29500"):
        with pytest.raises(Exception, match="names no single interface"):
            store_endpoint(every)
    env = rank_env({}, "10.0.0.1", 29500, nproc=4, nnodes=2, node_rank=1, local=2)
    assert env["RANK"] == "6" and env["LOCAL_RANK"] == "2" and env["WORLD_SIZE"] == "8"
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every rank a client of our store


@pytest.mark.e2e
def test_torchrun_s_store_listens_on_every_interface_though_told_loopback(tmp_path):
    """Why the train stage does not launch through torchrun (torch 2.13): this is the invocation
    it used, and its store listens on every interface. Should a torch upgrade fix it, this fails
    and the launcher can be reconsidered."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--local-addr", "127.0.0.1", "-m", PROBE,
    ]  # fmt: skip
    proc, guard = run_watched(cmd, timeout=120, cwd=REPO, env=rank_run_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sum 1" in proc.stdout
    assert port in {listener.port for listener in guard.beyond_loopback}


@pytest.mark.e2e
def test_two_ranks_on_one_node_rendezvous_on_loopback_alone(tmp_path):
    port = free_port()
    cmd = launcher_command(f"127.0.0.1:{port}", nproc=2)
    proc, guard = run_watched(cmd, timeout=120, cwd=REPO, env=rank_run_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("of 2: sum 3") == 2
    guard.check("two ranks on one node")
    launcher_ports = {
        listener.port
        for listener in guard.seen.values()
        if "pipeline.training.ranks" in listener.process
    }
    assert launcher_ports == {port}  # the store, which only the launcher opens


@pytest.mark.e2e
def test_two_nodes_meet_at_the_store_address_alone(tmp_path):
    """Two launchers as two nodes (the fabric here is loopback): node 1 may start first and
    waits for node 0's store; four ranks sum across both."""
    store = f"127.0.0.1:{free_port()}"
    env = rank_run_env(tmp_path)
    node1 = subprocess.Popen(
        launcher_command(store, nproc=2, nnodes=2, node_rank=1),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with ListenerGuard(lambda: [node1.pid]) as guard1:
            node0, guard0 = run_watched(
                launcher_command(store, nproc=2, nnodes=2, node_rank=0),
                timeout=180, cwd=REPO, env=env,
            )  # fmt: skip
            assert node0.returncode == 0, node0.stderr[-3000:]
            out1, err1 = node1.communicate(timeout=60)
    finally:
        kill_tree(node1.pid)
    assert node1.returncode == 0, err1[-3000:]
    assert (node0.stdout + out1).count("of 4: sum 10") == 4
    guard0.check("node 0")
    guard1.check("node 1")
    assert int(store.rsplit(":", 1)[1]) not in {listener.port for listener in guard1.seen.values()}


def launched(store: str, env: dict[str, str], **where: int) -> subprocess.Popen:
    return subprocess.Popen(
        launcher_command(store, **where),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.e2e
def test_a_failing_rank_stops_the_others_and_its_status_is_the_launcher_s(tmp_path):
    env = rank_run_env(tmp_path, PROBE_FAIL_RANK="1", PROBE_HANG_S="600")
    started = time.monotonic()
    proc = launched(f"127.0.0.1:{free_port()}", env, nproc=2)
    try:
        ranks: list[psutil.Process] = []
        while proc.poll() is None and len(ranks) < 2:
            ranks = psutil.Process(proc.pid).children()
            time.sleep(0.1)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 3, err[-2000:]
    assert "node 0 rank 1" in err and "exited with 3; stopping the others" in err
    assert time.monotonic() - started < 60
    assert not [rank for rank in ranks if rank.is_running() and rank.status() != "zombie"]


@pytest.mark.e2e
def test_a_rank_failing_on_one_node_stops_every_node(tmp_path):
    """Global rank 3 (node 1's second) fails: node 1 exits with its status, node 0 sees the
    failure in the store within seconds and stops its ranks (which wait on node 1's)."""
    store = f"127.0.0.1:{free_port()}"
    env = rank_run_env(tmp_path, PROBE_FAIL_RANK="3", PROBE_HANG_S="600")
    node0 = launched(store, env, nproc=2, nnodes=2, node_rank=0)
    node1 = launched(store, env, nproc=2, nnodes=2, node_rank=1)
    try:
        _, err1 = node1.communicate(timeout=90)
        _, err0 = node0.communicate(timeout=60)
    finally:
        kill_tree(node0.pid)
        kill_tree(node1.pid)
    assert node1.returncode == 3, err1[-2000:]
    assert node0.returncode == 1, err0[-2000:]
    assert "node 1 rank 1" in err0 and "stopping this node's ranks" in err0
