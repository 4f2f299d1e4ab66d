"""How training is launched: one process by default, torchrun for several devices (FSDP optional).

The command tests are unit tests of the launch line; the torchrun test is a real speculators
training run through torchrun at world size 1 on the tiny run's extracted data, as far as a
CPU-only machine can take the multi-GPU path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.core.config import ConfigError, load_profile
from pipeline.core.manifest import read_manifest
from pipeline.training.launch import train_command, train_env
from tests.helpers import TEST_OVERRIDES, run_stage, seed_run_dir

REPO = Path(__file__).parent.parent


def command(*overrides: str) -> list[str]:
    profile = load_profile(REPO / "configs/kimi-k2.5.yaml", list(overrides))
    layers = profile.verifier.capture_layer_ids
    return train_command(
        profile, "moonshotai/Kimi-K2.5", Path("/data/p"), Path("/data/ckpt"), layers
    )


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.unit
def test_one_device_runs_the_trainer_directly():
    cmd = command()
    assert cmd[:3] == [sys.executable, "-m", "pipeline.training.speculators_train"]
    assert "--fsdp-shard" not in cmd
    assert "GLOO_SOCKET_IFNAME" not in train_env(load_profile("configs/kimi-k2.5.yaml").train)


@pytest.mark.unit
def test_eight_devices_launch_through_torchrun_on_loopback_with_fsdp():
    cmd = command("train.num_devices=8", "train.fsdp_shard=true")
    entry = cmd.index("pipeline.training.speculators_train")
    launch, trainer = cmd[:entry], cmd[entry:]
    assert launch[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert option(launch, "--nproc-per-node") == "8" and option(launch, "--nnodes") == "1"
    assert option(launch, "--rdzv-endpoint").startswith("127.0.0.1:")
    assert option(launch, "--local-addr") == "127.0.0.1"
    assert "--standalone" not in launch  # its rendezvous store listens on every interface
    assert "--fsdp-shard" in trainer and "--trust-remote-code" in trainer
    profile = load_profile("configs/kimi-k2.5.yaml", ["train.num_devices=8"])
    env = train_env(profile.train)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"


@pytest.mark.unit
def test_fsdp_without_torchrun_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"train\.num_devices > 1 \(or train\.launcher=torchrun"):
        load_profile("configs/kimi-k2.5.yaml", ["train.fsdp_shard=true"])


@pytest.mark.e2e
def test_training_through_torchrun_at_world_size_1(tiny_run, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        *TEST_OVERRIDES,
        "train.launcher=torchrun",
        "train.epochs=1",
    ]
    profile = load_profile(REPO / "configs/tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "extract"))
    proc = run_stage("pipeline.train", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = read_manifest(profile, "train")["outputs"]
    assert out["command"][1:3] == ["-m", "torch.distributed.run"]
    assert out["distributed"] is True and out["world_size"] == 1  # seen by the rank itself
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
