"""Stage `train`: train the EAGLE-3 drafter with speculators on the extracted hidden states.

Run as: python -m pipeline.train --config configs/tiny.yaml

Reads `extract` (prepared data, hidden states, token frequencies, linked from ``train/data``,
where speculators also writes the draft-vocabulary maps) and `verifier`; writes
``<run>/train/checkpoints/<epoch>/`` in speculators format (config.json + model.safetensors,
loadable by vLLM as ``method: eagle3``), the trainer's log, and a manifest naming the drafter
checkpoint and the verifier, capture layers and chat template it was trained against.

With ``extract.mode: online`` extract stored no hidden states: this stage serves the verifier
as an extraction server (the same flags as extract) for the whole run, and speculators generates
each row's hidden states on demand (``--on-missing generate``) and deletes them once loaded. With
``extract.hidden_states_format: fp8`` speculators' fp8 backend dequantises the shards.

One device by default (``python -m pipeline.speculators_train``); ``train.num_devices > 1``
(or ``train.launcher: torchrun``) launches the same entry point through torchrun on this machine,
its collectives on loopback (but see :func:`launcher`: torchrun's store listens on every
interface), with FSDP sharding when ``train.fsdp_shard``;
``train.from_pretrained`` finetunes an existing drafter. speculators resumes from the newest
checkpoint in the save path, so a rerun after a crash continues instead of starting over.

Invariants: the trainer receives exactly the capture layer ids extraction used (without the
last layer, which speculators appends itself); the draft vocabulary comes from the token
frequencies of the supervised (assistant) tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from eval.spec_decode_metrics import scrape
from pipeline.build_verifier import resolved_verifier
from pipeline.config import Profile, TrainConfig
from pipeline.errors import PipelineError
from pipeline.extract import clear_staging, server_flags
from pipeline.logged_process import run_logged
from pipeline.manifest import (
    all_succeeded,
    drafter_digest,
    now,
    portable_drafter,
    read_manifest,
    stage_dir,
    write_manifest,
)
from pipeline.progress import watch
from pipeline.speculators_train import PROGRESS_FILE_ENV
from pipeline.vllm_server import LOOPBACK, free_port, vllm_server

ENTRY = "pipeline.speculators_train"


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
    online_v1: str | None = None,
    fp8: bool = False,
) -> list[str]:
    """speculators' training command; ``online_v1``: the extraction server for online mode,
    ``fp8``: the stored shards are fp8 (extract's manifest says which)."""
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
        "--target-layer-ids", *map(str, v.capture_layer_ids),
        "--token-freq-path", str(prepared / "token_freq.pt"),
        "--draft-vocab-size", str(t.draft_vocab_size),
        "--num-layers", str(t.num_layers),
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
    if t.from_pretrained:
        cmd += ["--from-pretrained", t.from_pretrained]
    return [*cmd, *t.extra_args]


def data_view(prepared: Path, view: Path) -> Path:
    """A folder of links to extract's data, so the vocab maps speculators writes land here."""
    view.mkdir(parents=True, exist_ok=True)
    for item in prepared.iterdir():
        if item.name.startswith(("d2t-", "t2d-")):
            continue
        link = view / item.name
        if not link.is_symlink():
            link.symlink_to(item.resolve())
    return view


def final_checkpoint(save: Path) -> Path:
    """The checkpoint to ship: speculators' best (if kept), else the newest epoch."""
    best = save / "checkpoint_best"  # a symlink speculators keeps with --save-best
    if (best / "config.json").exists():
        return best.resolve()
    epochs = sorted((p for p in save.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise TrainError(f"training wrote no checkpoint under {save}")
    return epochs[-1]


def checked_drafter(profile: Profile, save: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to ship and its config, once it reads the layers the profile captures."""
    drafter = final_checkpoint(save)
    config = json.loads((drafter / "config.json").read_text())
    if config["eagle_aux_hidden_state_layer_ids"] != profile.verifier.capture_layer_ids:
        raise TrainError(
            f"the drafter records capture layers {config['eagle_aux_hidden_state_layer_ids']} "
            f"but the profile extracted {profile.verifier.capture_layer_ids}"
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


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    verifier = resolved_verifier(profile)
    extract = read_manifest(profile, "extract")
    folder = stage_dir(profile, "train")
    folder.mkdir(parents=True, exist_ok=True)
    prepared = data_view(
        stage_dir(profile, "extract") / extract["outputs"]["prepared"], folder / "data"
    )
    save = folder / "checkpoints"
    steps = folder / "progress.json"
    with contextlib.ExitStack() as stack:
        online = None
        mode = extract["outputs"].get("mode", "offline")  # manifests before online mode lack it
        if mode == "online":
            staging = folder / "online-staging"
            clear_staging(staging)
            server = vllm_server(
                profile,
                verifier["model"],
                folder / "vllm.log",
                use_base_url=False,  # server.base_url is a deployment, not an extraction server
                served_model_name=verifier["model"],  # the name speculators asks for
                **server_flags(profile, staging),
            )
            online = stack.enter_context(server)
        fp8 = extract["outputs"]["dtype"] == "float8_e4m3fn"
        online_v1 = online.v1 if online else None
        cmd = train_command(profile, verifier["model"], prepared, save, online_v1, fp8)
        bar = stack.enter_context(
            watch(
                lambda: read_steps(steps)[0],
                lambda: read_steps(steps)[1],
                desc="train",
                unit="step",
            )
        )
        env = {**train_env(profile.train), PROGRESS_FILE_ENV: str(steps)}
        run_logged(cmd, folder / "train.log", TrainError, "speculators training", env=env)
        if bar.total:  # the steps after the last logged one
            bar.update(bar.total - bar.n)
        # Tokens the extraction server ran for training: the measured cost of online mode.
        generated_tokens = int(scrape(online.base_url).prompt_tokens) if online else 0
    drafter, config = checked_drafter(profile, save)
    portable_drafter(profile, drafter)  # published as evaluated: no path of this machine
    state_path, metrics_path = drafter / "training_state.json", drafter / "val_metrics.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    outputs = {
        "drafter": str(drafter),
        "checkpoint": drafter.name,
        "drafter_sha256": drafter_digest(drafter),
        "global_steps": state.get("global_step") or read_steps(steps)[1],
        "val_metrics": json.loads(metrics_path.read_text()) if metrics_path.exists() else None,
        "draft_vocab_size": config["draft_vocab_size"],
        "device": "cpu" if _no_accelerator() else "accelerator",
        # As the ranks themselves saw it: torchrun's process group, and how many ranks.
        "distributed": trainer_state(steps).get("distributed"),
        "world_size": trainer_state(steps).get("world_size"),
        "command": cmd,
        "hidden_states": {
            "mode": mode,
            "dtype": extract["outputs"]["dtype"],
            "tokens_generated_online": generated_tokens,
        },
        "verifier": {
            "model": verifier["model"],
            "capture_layer_ids": profile.verifier.capture_layer_ids,
            "chat_template_sha256": verifier["chat_template_sha256"],
        },
    }
    return write_manifest(
        profile,
        "train",
        started_at=started,
        counts=all_succeeded(extract["outputs"]["rows"]),
        outputs=outputs,
        inputs=("verifier", "extract"),
        data_revision=extract["data_revision"],
    )


def _no_accelerator() -> bool:
    import torch

    return not torch.accelerator.is_available()


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_stage

    run_stage("train", run, argv)


if __name__ == "__main__":
    main()
