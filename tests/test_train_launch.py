"""How training is launched: one process by default, the rank launcher for several ranks (FSDP
optional), across nodes with the store on the fabric address alone.

The command tests are unit tests of the launch line; the multi-rank test is a real speculators
training run of two CPU ranks on the tiny run's extracted data, as far as a CPU-only machine can
take the multi-GPU path, with every listener of its process tree watched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.core.config import ConfigError, load_profile
from pipeline.core.manifest import read_manifest
from pipeline.training.launch import TrainError, rendezvous, train_command, train_env
from tests.helpers import TEST_OVERRIDES, seed_run_dir, stage_command, stage_env
from tests.listener_guard import run_watched

REPO = Path(__file__).parent.parent


def command(*overrides: str) -> list[str]:
    profile = load_profile(REPO / "configs/kimi-k2.5.yaml", list(overrides))
    layers = profile.verifier.capture_layer_ids
    store = rendezvous(profile.train)
    return train_command(
        profile, "moonshotai/Kimi-K2.5", Path("/data/p"), Path("/data/ckpt"), layers, store=store
    )


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.unit
def test_one_device_runs_the_trainer_directly_and_opens_no_store():
    cmd = command()
    assert cmd[:3] == [sys.executable, "-m", "pipeline.training.speculators_train"]
    assert "--fsdp-shard" not in cmd
    train = load_profile("configs/kimi-k2.5.yaml").train
    assert rendezvous(train) is None
    assert "GLOO_SOCKET_IFNAME" not in train_env(None)


@pytest.mark.unit
def test_eight_devices_launch_ranks_around_a_loopback_store_with_fsdp():
    cmd = command("train.num_devices=8", "train.fsdp_shard=true")
    entry = cmd.index("pipeline.training.speculators_train")
    launch, trainer = cmd[:entry], cmd[entry:]
    assert launch[:3] == [sys.executable, "-m", "pipeline.training.ranks"]
    assert option(launch, "--nproc-per-node") == "8" and option(launch, "--nnodes") == "1"
    assert option(launch, "--store").startswith("127.0.0.1:")
    assert "torch.distributed.run" not in cmd  # its store listens on every interface
    assert "--fsdp-shard" in trainer and "--trust-remote-code" in trainer
    profile = load_profile("configs/kimi-k2.5.yaml", ["train.num_devices=8"])
    env = train_env(rendezvous(profile.train))
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "=lo"


NODES = ["train.num_devices=8", "train.nodes.count=2", "train.nodes.store_address=10.1.0.1",
         "train.nodes.interface=lo"]  # fmt: skip


@pytest.mark.unit
def test_across_nodes_the_store_listens_on_the_fabric_address_the_profile_names():
    cmd = command(*NODES, "train.nodes.rank=1", "train.nodes.store_port=29511")
    assert option(cmd, "--store") == "10.1.0.1:29511"
    assert option(cmd, "--nnodes") == "2" and option(cmd, "--node-rank") == "1"
    profile = load_profile("configs/kimi-k2.5.yaml", [*NODES, "train.nodes.rank=0"])
    store = rendezvous(profile.train)
    assert store.record() == {
        "store": "10.1.0.1:29500",
        "nodes": 2,
        "node_rank": 0,
        "interface": "lo",
    }
    assert profile.train.world_size == 16


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.nodes.store_address=0.0.0.0", "names no single interface"),
        ("train.nodes.store_address='::'", "names no single interface"),
        ("train.nodes.store_address='::ffff:0.0.0.0'", "names no single interface"),
        ("train.nodes.store_address=node0", "is not an IP address"),
        ("train.nodes.rank=2", "rank 2 is not below count 2"),
    ],
)
def test_a_store_address_of_every_interface_or_a_wrong_node_is_refused(override, message):
    overrides = [*NODES, "train.nodes.rank=0", override]
    with pytest.raises(ConfigError, match=message):
        load_profile("configs/kimi-k2.5.yaml", overrides)


@pytest.mark.unit
def test_a_fabric_interface_this_machine_lacks_is_named():
    overrides = [*NODES, "train.nodes.rank=0", "train.nodes.interface=ib-missing"]
    profile = load_profile("configs/kimi-k2.5.yaml", overrides)
    with pytest.raises(
        TrainError, match=r"'ib-missing' is not a network interface .*\(it has .*lo"
    ):
        rendezvous(profile.train)


@pytest.mark.unit
def test_fsdp_with_one_rank_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"set train\.num_devices > 1"):
        load_profile("configs/kimi-k2.5.yaml", ["train.fsdp_shard=true"])


@pytest.mark.e2e
def test_training_two_cpu_ranks_listens_on_loopback_alone(tiny_extracted, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        *TEST_OVERRIDES,
        "train.num_devices=2",
        "train.epochs=1",
    ]
    profile = load_profile(REPO / "configs/tiny.yaml", overrides)
    seed_run_dir(tiny_extracted, profile, ("verifier", "generate", "extract"))
    proc, guard = run_watched(
        stage_command("pipeline.train", *overrides), timeout=600, cwd=REPO,
        env=stage_env({"TMPDIR": str(tmp_path)}),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    guard.check("training with two ranks")
    out = read_manifest(profile, "train")["outputs"]
    assert out["command"][1:3] == ["-m", "pipeline.training.ranks"]
    assert out["distributed"] is True and out["world_size"] == 2  # seen by the ranks themselves
    store = out["rendezvous"]["store"]
    assert store.startswith("127.0.0.1:") and out["rendezvous"]["interface"] == "lo"
    assert int(store.rsplit(":", 1)[1]) in {listener.port for listener in guard.seen.values()}
    config = json.loads((Path(out["drafter"]) / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == profile.verifier.capture_layer_ids
    assert out["global_steps"] > 0


@pytest.mark.unit
def test_the_step_total_counts_each_epoch_s_own_batches():
    """A packing sampler draws another number of batches each epoch: the progress total is
    their sum, not epochs x the first epoch's (which left the bar short of its end)."""
    from pipeline.training.speculators_train import batches_per_epoch

    class PackingSampler:
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    class Loader:
        batch_sampler = PackingSampler()

        def __len__(self) -> int:
            return 82 - 3 * self.batch_sampler.epoch

    loader = Loader()
    loader.batch_sampler.set_epoch(2)
    assert batches_per_epoch(loader, 3) == [82, 79, 76]
    assert loader.batch_sampler.epoch == 2  # left as it was found


@pytest.mark.e2e
@pytest.mark.slow
def test_training_on_two_nodes_of_one_rank_over_loopback(tiny_run, tmp_path):
    """speculators' training across two "nodes" (two train stages, node ranks 0 and 1, one CPU
    rank each; the fabric is loopback): the global rank shards the data, rank 0 alone saves, in
    the run folder both nodes share; node 0 writes the manifest."""
    import subprocess

    from pipeline.serving.vllm_api import free_port
    from tests.listener_guard import ListenerGuard

    overrides = [
        f"run.output_dir={tmp_path}", *TEST_OVERRIDES, "train.epochs=1",
        "train.nodes.count=2", "train.nodes.store_address=127.0.0.1",
        f"train.nodes.store_port={free_port()}", "train.nodes.interface=lo",
    ]  # fmt: skip
    profile = load_profile(REPO / "configs/tiny.yaml", [*overrides, "train.nodes.rank=0"])
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "extract"))
    env = stage_env({"TMPDIR": str(tmp_path)})
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    nodes = [
        subprocess.Popen(
            stage_command("pipeline.train", *overrides, f"train.nodes.rank={rank}"),
            cwd=REPO,
            env=env,
            **pipes,
        )
        for rank in (1, 0)  # node 1 first: it waits for node 0's store
    ]
    with ListenerGuard(lambda: [p.pid for p in nodes]) as guard:
        outs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    guard.check("training on two nodes")
    out = read_manifest(profile, "train")["outputs"]
    assert out["world_size"] == 2 and out["rendezvous"]["nodes"] == 2
    one_node = read_manifest(tiny_run, "train")["outputs"]
    epochs = tiny_run.train.epochs
    # Each rank trains on half of the rows: about half the steps of one rank, per epoch.
    assert out["global_steps"] == pytest.approx(one_node["global_steps"] / epochs / 2, rel=0.1)
    assert (tmp_path / "tiny/train/node1/train.log").is_file()
