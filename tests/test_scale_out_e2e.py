"""The tiny pipeline's generate and extract sharded over a real two-node Ray cluster on
127.0.0.1, one node lost mid-run, merged exactly (pipeline.tools.ray_shards, pipeline.core.shards).

The cluster is Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``): a head and a
worker node, each a real GCS/raylet, both on 127.0.0.1 (Ray rewrites 127.0.0.1 to the host's
address everywhere else), token authentication on, failure detection shortened to about 1.5 s.
The two nodes share one tiny vLLM server for generation (the point is the scheduling and the
contract); each extract shard starts its own extraction server, as on a real node. While an
extract shard runs on the worker node, the whole node is killed (its raylet and every process
under it, the shard's stage and server included): Ray runs the shard again on the head.

Checked: the merged responses hold each prompt id exactly once and are the one-box run's greedy
responses; the merged extraction links (never copies) every shard's hidden states under the
whole's row numbers, each matching its row's tokens; nothing listened beyond loopback and no
process of the test is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from safetensors import safe_open

from pipeline.core.config import Profile, load_profile
from pipeline.core.manifest import read_manifest
from pipeline.core.shards import Shard, shard_folder
from pipeline.serving.vllm_server import vllm_server
from pipeline.tools.ray_shards import RECORD
from tests.helpers import (
    alive_after,
    run_stage,
    seed_run_dir,
    skip_unless_ci,
    stage_env,
    verifier_model,
)
from tests.listener_guard import ListenerGuard, kill_tree
from tests.slurm_cluster import missing_tools, slurm_cluster, wait_for_jobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
REPO = Path(__file__).parent.parent
SAMPLES = 32
SHARDS = 2
# Greedy, so that the sharded run must give the one-box run's replies token for token.
COMMON = [f"data.max_samples={SAMPLES}", "generate.temperature=0", "generate.max_tokens=128"]
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # with it, the driver connects on 127.0.0.1
    "RAY_AUTH_MODE": "token",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


@pytest.fixture
def ray_cluster(monkeypatch):
    """A head and a worker node on 127.0.0.1, one CPU each; both gone afterwards."""
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    for key, value in {**RAY_ENV, "RAY_TMPDIR": str(temp)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray.cluster_utils import Cluster  # reads the authentication mode when imported

    cluster = Cluster()
    try:
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False)
        worker = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1)
        yield cluster, worker
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    # Every process the cluster started (raylets, workers, the runner, its stages) inherited
    # this cluster's RAY_TMPDIR; none may outlive it.
    assert not alive_after([p for p in psutil.process_iter() if _of_cluster(p, temp)], 10)


def _of_cluster(proc: psutil.Process, temp: Path) -> bool:
    try:
        return proc.pid != os.getpid() and proc.environ().get("RAY_TMPDIR") == str(temp)
    except psutil.Error:
        return False


def runner(profile_args: list[str], stage: str, address: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipeline.tools.ray_shards", "--address", address,
           "--config", "configs/tiny.yaml", "--stage", stage, "--shards", str(SHARDS),
           "--retries", "2", "--timeout-s", "900", *profile_args]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the Ray runner ran past {timeout} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def lose_node(node) -> int:
    """Kill a Ray node as a lost machine dies: its raylet and every process under it."""
    raylet = node.all_processes["raylet"][0].process.pid
    doomed = psutil.Process(raylet).children(recursive=True)
    kill_tree(raylet)
    return len(doomed)


def ran_by_ray(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / stage / "shards" / RECORD).read_text())


def responses(run_dir: Path) -> dict[str, dict]:
    lines = (run_dir / "generate" / "responses.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "a prompt id is in the responses twice"
    return by_id


@pytest.fixture(scope="module")
def shared_server(tiny_verifier, tmp_path_factory):
    """One tiny vLLM server that every "node" of the module's runs generates against, and the
    one-box run's greedy replies on it: (replica_urls override, one-box profile)."""
    folder = tmp_path_factory.mktemp("one-box")
    one_box = [f"run.output_dir={folder}", *COMMON]
    profile = load_profile(REPO / "configs/tiny.yaml", one_box)
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    with vllm_server(
        profile, verifier_model(profile), folder / "shared-vllm.log", use_base_url=False
    ) as server:
        replicas = f"generate.replica_urls={json.dumps([server.base_url])}"
        proc = run_stage("pipeline.generate", *one_box, replicas)
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield replicas, profile


def sharded_profile(tiny_verifier, folder: Path) -> tuple[list[str], Profile]:
    args = [f"run.output_dir={folder}", *COMMON]
    profile = load_profile(REPO / "configs/tiny.yaml", args)
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    return args, profile


def check_merged_generate(one_box: Profile, sharded: Profile) -> None:
    """Each prompt id once, the one-box run's greedy replies, the counts summed."""
    mine, theirs = responses(one_box.run.run_dir), responses(sharded.run.run_dir)
    assert mine.keys() == theirs.keys() and len(mine) == SAMPLES
    differing = [i for i in mine if mine[i]["conversations"] != theirs[i]["conversations"]]
    assert not differing, f"sharded replies differ from the one-box run's: {differing}"
    one, merged = read_manifest(one_box, "generate"), read_manifest(sharded, "generate")
    for key in ("input", "succeeded", "skipped", "failed", "completion_tokens"):
        assert merged["counts"][key] == one["counts"][key], key
    assert merged["outputs"]["shards"]["count"] == SHARDS


def test_shards_over_two_ray_nodes_one_lost_merge_exactly(
    tiny_verifier, tmp_path, shared_server, ray_cluster
):
    cluster, worker = ray_cluster
    replicas, one_box = shared_server
    sharded, profile = sharded_profile(tiny_verifier, tmp_path)
    sharded_run = profile.run.run_dir
    started = time.monotonic()
    with ListenerGuard(lambda: [os.getpid()]) as guard:
        out = finish(runner([*sharded, replicas], "generate", cluster.address), 600)
        generated = time.monotonic()
        ran = ran_by_ray(sharded_run, "generate")
        assert len(ran["ran"]) == SHARDS, out[-3000:]
        assert len({r["node"] for r in ran["ran"].values()}) == 2, "both nodes ran shards"

        # Extract: lose the worker node while one of its shards runs.
        proc = runner(sharded, "extract", cluster.address)
        nodes = sorted(node.node_id for node in cluster.list_all_nodes())  # as the runner's
        on_worker = [k for k in range(SHARDS) if nodes[k % len(nodes)] == worker.node_id]
        watched = [
            shard_folder(sharded_run / "extract", Shard(k, SHARDS)) / "vllm.log" for k in on_worker
        ]
        deadline = time.monotonic() + 300
        while not any(p.exists() for p in watched):
            assert proc.poll() is None and time.monotonic() < deadline, "no shard on the worker"
            time.sleep(0.5)
        time.sleep(3)  # its server is starting: the node dies mid-shard
        killed = lose_node(worker)
        lost_at = time.monotonic()
        out = finish(proc, 900)
        extracted = time.monotonic()
    cluster.remove_node(worker, allow_graceful=False)
    guard.check("the sharded run (Ray nodes, runner, stages, vLLM servers)")

    ran = ran_by_ray(sharded_run, "extract")
    assert len(ran["ran"]) == SHARDS, out[-3000:]
    # The worker died in its first shard: that shard, and every later one, finished on the head.
    assert killed > 0
    assert {r["node"] for r in ran["ran"].values()} == {cluster.head_node.node_id}, ran

    check_merged_generate(one_box, profile)

    # Extract: the shards' hidden states linked in, row i's tokens in row i's shard file.
    import datasets

    extract = read_manifest(profile, "extract")
    prepared = sharded_run / "extract" / "prepared"
    table = datasets.load_from_disk(str(prepared))
    assert extract["outputs"]["rows"] == len(table) == extract["outputs"]["files"]
    assert (
        extract["outputs"]["hidden_state_bytes"]
        == extract["outputs"]["expected_hidden_state_bytes"]
    )
    for i, row in enumerate(table):
        path = prepared / "hidden_states" / f"hs_{i}.safetensors"
        assert path.is_symlink() and not os.path.isabs(os.readlink(path))
        with safe_open(path, framework="pt") as f:
            assert f.get_tensor("token_ids").tolist() == list(row["input_ids"])
    print(
        f"generate ({SHARDS} shards) {generated - started:.0f} s, extract over Ray "
        f"{extracted - generated:.0f} s, done {extracted - lost_at:.0f} s after the node was lost"
    )


def test_the_slurm_array_runs_each_shard_and_the_merge_is_exact(
    tiny_verifier, tmp_path, shared_server
):
    """configs/scale-out/shards.sbatch as an array of 2 on a one-host Slurm cluster (its
    daemons on 127.0.0.1 alone): SLURM_ARRAY_TASK_ID is the shard, each task `make generate`
    for its shard against the shared server; merged, it is the one-box run."""
    if missing := missing_tools():
        tools = ", ".join(missing)
        skip_unless_ci(f"Slurm is not installed here ({tools}): run `make scale-out-tools`")
    replicas, one_box = shared_server
    sharded, profile = sharded_profile(tiny_verifier, tmp_path / "runs")
    script = REPO / "configs" / "scale-out" / "shards.sbatch"
    with (
        ListenerGuard(lambda: [os.getpid()]) as guard,
        slurm_cluster(tmp_path / "slurm") as env,
    ):
        env |= {"STAGE": "generate", "CONFIG": "configs/tiny.yaml", "PROGRESS": "0",
                "SHARDS": str(SHARDS),
                "ARGS": " ".join([*sharded, replicas])}  # fmt: skip
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--array=0-{SHARDS - 1}", "--export=ALL",
             f"--output={tmp_path}/slurm-%a.log", str(script)],
            cwd=REPO, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        wait_for_jobs(env, proc.stdout.strip(), 600)
    guard.check("the one-host Slurm cluster")
    logs = "".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("slurm-*.log")))
    for k in range(SHARDS):
        assert (
            shard_folder(profile.run.run_dir / "generate", Shard(k, SHARDS)) / "manifest.json"
        ).is_file(), logs
    proc = run_stage("pipeline.generate", *sharded, "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_merged_generate(one_box, profile)
