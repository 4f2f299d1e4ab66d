"""Launching speculators' EAGLE-3 trainer, and reading what it wrote.

The trainer runs as ``python -m pipeline.training.speculators_train`` when it has one rank.
With several (``train.num_devices > 1``, or ``train.nodes``) :mod:`pipeline.training.ranks`
starts them around a rendezvous store it hosts itself, listening on 127.0.0.1 on one node and
on the profile's fabric address alone across nodes (torchrun's store would listen on every
interface); the ranks' collectives use loopback, or the fabric's interface. The trainer reports
its steps to a small JSON file (:func:`read_steps`) and writes one checkpoint per epoch;
:func:`checked_drafter` picks the one to ship and refuses it unless it reads the layers
extraction captured.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pipeline.core.config import Profile, TrainConfig
from pipeline.core.drafter import aux_layer_ids, drafter_config
from pipeline.core.errors import PipelineError
from pipeline.serving.vllm_api import LOOPBACK, free_port
from pipeline.training import ranks
from pipeline.training.pretrained_drafter import PretrainedStart

ENTRY = "pipeline.training.speculators_train"


class TrainError(PipelineError):
    """Training failed; the message points at the trainer log."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks' store listens (the only address it listens on) and which node this is."""

    host: str
    port: int
    nodes: int
    node_rank: int
    interface: str  # the network interface of the ranks' collectives

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def record(self) -> dict[str, Any]:
        return {
            "store": self.endpoint,
            "nodes": self.nodes,
            "node_rank": self.node_rank,
            "interface": self.interface,
        }


def check_fabric(train: TrainConfig) -> None:
    """Refuse a fabric interface this machine does not have, naming those it has."""
    if train.nodes is None:
        return
    interfaces = psutil.net_if_addrs()
    if train.nodes.interface not in interfaces:
        raise TrainError(
            f"train.nodes.interface {train.nodes.interface!r} is not a network interface of "
            f"this machine (it has {', '.join(sorted(interfaces))}): name the private fabric's"
        )


def rendezvous(train: TrainConfig) -> Rendezvous | None:
    """The store of a run with several ranks; None for one rank, which opens no store."""
    if not train.distributed:
        return None
    nodes = train.nodes
    if nodes is None:
        return Rendezvous(LOOPBACK, free_port(), 1, 0, "lo")
    check_fabric(train)
    return Rendezvous(
        nodes.store_address, nodes.store_port, nodes.count, nodes.rank, nodes.interface
    )


def launcher(train: TrainConfig, store: Rendezvous | None) -> list[str]:
    """The trainer's entry point: directly for one rank, else through the rank launcher."""
    if store is None:
        return [sys.executable, "-m", ENTRY]
    return [
        sys.executable, "-m", ranks.MODULE,
        "--nproc-per-node", str(train.num_devices),
        "--nnodes", str(store.nodes), "--node-rank", str(store.node_rank),
        "--store", store.endpoint,
        "-m", ENTRY,
    ]  # fmt: skip


def train_env(store: Rendezvous | None) -> dict[str, str]:
    """The trainer's environment: collectives between ranks on the store's interface."""
    env = dict(os.environ)
    if store is not None:  # NCCL takes a prefix unless "=" asks for this interface exactly
        env |= {"GLOO_SOCKET_IFNAME": store.interface, "NCCL_SOCKET_IFNAME": f"={store.interface}"}
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
    store: Rendezvous | None = None,
    train_data_ratio: float | None = None,
) -> list[str]:
    """speculators' training command; ``capture_layer_ids``: the aux layers extraction
    captured (without the last, which speculators appends), ``online_v1``: the extraction
    server for online mode, ``fp8``: the stored shards are fp8 (extract's manifest says which),
    ``pretrained``: the drafter to finetune, whose own shape and draft vocabulary are kept,
    ``store``: the rendezvous of several ranks (:func:`rendezvous`), ``train_data_ratio``: the
    split of a token budget's view (pipeline.training.token_budget), else the profile's."""
    t, v = profile.train, profile.verifier
    if (store is None) != (not t.distributed):
        raise ValueError(f"train.world_size {t.world_size} needs a rendezvous: see rendezvous()")
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
        *launcher(t, store),
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", verifier,
        "--data-path", str(prepared),
        "--target-layer-ids", *map(str, capture_layer_ids),
        *draft_model_flags(t, prepared, pretrained),
        "--epochs", str(t.epochs),
        "--lr", str(t.learning_rate),
        "--total-seq-len", str(t.total_seq_len),
        "--train-data-ratio", str(train_data_ratio or t.train_data_ratio),
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
    if t.optimizer:
        cmd += ["--optimizer", t.optimizer]
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
