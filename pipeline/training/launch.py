"""Launching speculators' EAGLE-3 trainer, and reading what it wrote.

The trainer runs as ``python -m pipeline.training.speculators_train`` on one device, or through
torchrun on this machine (collectives on loopback; but see :func:`launcher`: torchrun's store
listens on every interface). It reports its steps to a small JSON file (:func:`read_steps`) and
writes one checkpoint per epoch; :func:`checked_drafter` picks the one to ship and refuses it
unless it reads the layers extraction captured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile, TrainConfig
from pipeline.core.drafter import aux_layer_ids, drafter_config
from pipeline.core.errors import PipelineError
from pipeline.serving.vllm_api import LOOPBACK, free_port
from pipeline.training.pretrained_drafter import PretrainedStart

ENTRY = "pipeline.training.speculators_train"


class TrainError(PipelineError):
    """Training failed; the message points at the trainer log."""


def launcher(train: TrainConfig) -> list[str]:
    """The trainer's entry point, directly or through torchrun on this one machine."""
    if not train.torchrun:
        return [sys.executable, "-m", ENTRY]
    # One node. The endpoint names loopback, yet with torch 2.13 torchrun's c10d store (and its
    # agent) listens on every interface whatever the endpoint or MASTER_ADDR says: an
    # unauthenticated store open to the network while training runs (issue 24 tracks the fix,
    # e.g. a FileStore or a store handed a socket bound to 127.0.0.1).
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(train.num_devices),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{free_port()}",
        "--local-addr", LOOPBACK,
        "-m", ENTRY,
    ]  # fmt: skip


def train_env(train: TrainConfig) -> dict[str, str]:
    """The trainer's environment: collective traffic between ranks stays on loopback."""
    env = dict(os.environ)
    if train.torchrun:
        env |= {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "MASTER_ADDR": LOOPBACK}
    return env


def train_command(
    profile: Profile,
    verifier: str,
    prepared: Path,
    save: Path,
    capture_layer_ids: list[int],
    online_v1: str | None = None,
    fp8: bool = False,
    pretrained: PretrainedStart | None = None,
) -> list[str]:
    """speculators' training command; ``capture_layer_ids``: the aux layers extraction
    captured (without the last, which speculators appends), ``online_v1``: the extraction
    server for online mode, ``fp8``: the stored shards are fp8 (extract's manifest says which),
    ``pretrained``: the drafter to finetune, whose own shape and draft vocabulary are kept."""
    t, v = profile.train, profile.verifier
    if online_v1:
        hidden_states = ["--on-missing", "generate", "--vllm-endpoint", online_v1,
                         "--request-timeout", str(profile.generate.request_timeout_s),
                         "--max-retries", str(profile.generate.max_retries)]  # fmt: skip
    else:
        hidden_states = ["--on-missing", "raise"]
    if fp8:
        hidden_states += ["--hidden-states-backend", "fp8"]
    hidden_dtype = "float32" if v.dtype == "float32" else "bfloat16"
    cmd = [
        *launcher(t),
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", verifier,
        "--data-path", str(prepared),
        "--target-layer-ids", *map(str, capture_layer_ids),
        *draft_model_flags(t, prepared, pretrained),
        "--epochs", str(t.epochs),
        "--lr", str(t.learning_rate),
        "--total-seq-len", str(t.total_seq_len),
        "--train-data-ratio", str(t.train_data_ratio),
        "--hidden-states-dtype", hidden_dtype,
        "--draft-attn-impl", t.draft_attn_impl,
        "--loss-implementation", t.loss_implementation,
        "--num-workers", str(t.num_workers),
        *hidden_states,
        "--seed", str(profile.run.seed),
        "--log-freq", str(t.log_every),
        "--save-path", str(save),
        "--log-dir", str(save.parent / "logs"),
    ]  # fmt: skip
    if v.trust_remote_code:
        cmd.append("--trust-remote-code")
    if t.save_best:
        cmd.append("--save-best")
    if t.fsdp_shard:
        cmd.append("--fsdp-shard")
    if t.max_steps:
        cmd += ["--max-steps", str(t.max_steps)]
    return [*cmd, *t.extra_args]


def draft_model_flags(
    t: TrainConfig, prepared: Path, pretrained: PretrainedStart | None
) -> list[str]:
    """A fresh drafter's shape and draft vocabulary (from the token frequencies), or the
    pretrained one with its own maps (speculators refuses shaping flags beside it)."""
    if pretrained is None:
        return [
            "--token-freq-path", str(prepared / "token_freq.pt"),
            "--draft-vocab-size", str(t.draft_vocab_size),
            "--num-layers", str(t.num_layers),
        ]  # fmt: skip
    return [
        "--from-pretrained", str(pretrained.drafter),
        "--d2t-path", str(pretrained.d2t),
        "--t2d-path", str(pretrained.t2d),
        "--draft-vocab-size", str(pretrained.draft_vocab_size),
    ]  # fmt: skip


def final_checkpoint(save: Path) -> Path:
    """The checkpoint to ship: speculators' best (if kept), else the newest epoch."""
    best = save / "checkpoint_best"  # a symlink speculators keeps with --save-best
    if (best / "config.json").exists():
        return best.resolve()
    epochs = sorted((p for p in save.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise TrainError(f"training wrote no checkpoint under {save}")
    return epochs[-1]


def checked_drafter(save: Path, capture_layer_ids: list[int]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to ship and its config, once it reads the layers extraction captured."""
    drafter = final_checkpoint(save)
    config = drafter_config(drafter)
    if aux_layer_ids(config) != capture_layer_ids:
        raise TrainError(
            f"the drafter records capture layers {aux_layer_ids(config)} "
            f"but extraction captured {capture_layer_ids}"
        )
    return drafter, config


def trainer_state(path: Path) -> dict[str, Any]:
    """What the trainer last reported (steps done, total steps, world size); {} before that."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_steps(path: Path) -> tuple[int, int | None]:
    """(steps done, total steps) as the trainer last reported them; (0, None) before that."""
    state = trainer_state(path)
    return state.get("global_step", 0), state.get("total_steps")
