"""Stage `train`: train the EAGLE-3 drafter with speculators on the extracted hidden states.

Run as: python -m pipeline.train --config configs/tiny.yaml

Reads `extract` (prepared data, hidden states, token frequencies, linked from ``train/data``,
where speculators also writes the draft-vocabulary maps; with ``train.max_train_tokens``, a
dataset of the rows that budget keeps: :mod:`pipeline.training.token_budget`) and `verifier`; writes
``<run>/train/checkpoints/<epoch>/`` in speculators format (config.json + model.safetensors,
loadable by vLLM as ``method: eagle3``), the trainer's log, and a manifest naming the drafter
checkpoint and the verifier, capture layers and chat template it was trained against.

With ``extract.mode: online`` extract stored no hidden states: this stage serves the verifier
as an extraction server (the same flags as extract) for the whole run, and speculators generates
each row's hidden states on demand (``--on-missing generate``) and deletes them once loaded. With
``extract.hidden_states_format: fp8`` speculators' fp8 backend dequantises the shards.

One rank by default (``python -m pipeline.training.speculators_train``); ``train.num_devices > 1``
starts that many ranks of the same entry point through :mod:`pipeline.training.ranks`, around a
rendezvous store listening on 127.0.0.1 alone and with collectives on loopback, with FSDP
sharding when ``train.fsdp_shard``. With ``train.nodes`` each machine runs this stage with its own
``train.nodes.rank``; node 0's store listens on the fabric address the profile names and on
nothing else, and the manifest records it. Node 0 works in ``train/`` and writes the manifest;
another node works in ``train/node<R>/`` (its own views, staging and log). speculators saves
from global rank 0 alone and every rank reads the checkpoints on resume, so ``run.output_dir``
must be storage all nodes share;
``train.from_pretrained`` finetunes a published drafter in either layout
(:mod:`pipeline.training.pretrained_drafter`): refused by name unless it fits the verifier and
reads the layers extraction captured, converted to speculators' format when it is in the
original EAGLE layout, its embedding the verifier's when it has none, and trained with its own
draft vocabulary (``--d2t-path``/``--t2d-path``), never one recomputed from our data.
speculators resumes from the newest checkpoint in the save path, so a rerun after a crash
continues instead of starting over.

Invariants: the trainer receives exactly the capture layer ids extraction used (without the
last layer, which speculators appends itself); a fresh drafter's draft vocabulary comes from
the token frequencies of the supervised (assistant) tokens, a finetuned one keeps its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from pipeline.core.config import Profile
from pipeline.core.contracts import ExtractOutputs, TrainOutputs, VerifierOutputs
from pipeline.core.drafter import drafter_digest
from pipeline.core.manifest import (
    all_succeeded,
    now,
    read_input,
    stage_dir,
    write_manifest,
)
from pipeline.core.portable import portable_drafter
from pipeline.core.progress import watch
from pipeline.core.serving_platform import serving_platform
from pipeline.serving.extraction import clear_staging, server_flags
from pipeline.serving.logged_process import run_logged
from pipeline.serving.spec_decode_metrics import scrape
from pipeline.serving.vllm_api import Endpoint, served_chat_template_sha256
from pipeline.serving.vllm_server import vllm_server
from pipeline.training.launch import (
    Rendezvous,
    TrainError,
    check_fabric,
    checked_drafter,
    read_steps,
    rendezvous,
    train_command,
    train_env,
    trainer_state,
)
from pipeline.training.pretrained_drafter import start_from
from pipeline.training.speculators_train import PROGRESS_FILE_ENV
from pipeline.training.text_view import name_verifier, text_view, verifier_config
from pipeline.training.token_budget import training_view

log = logging.getLogger(__name__)


def extraction_server(
    profile: Profile, verifier: str, folder: Path, stack: contextlib.ExitStack, asked_as: str
) -> Endpoint:
    """Online mode: the verifier served as an extraction server for the whole run, under the
    name speculators asks for (``asked_as``: the path it was given)."""
    staging = folder / "online-staging"
    clear_staging(staging)
    server = vllm_server(
        profile,
        verifier,
        folder / "vllm.log",
        use_base_url=False,  # server.base_url is a deployment, not an extraction server
        served_model_name=asked_as,
        **server_flags(profile, staging),
    )
    return stack.enter_context(server)


def run_trainer(folder: Path, cmd: list[str], store: Rendezvous | None) -> None:
    """speculators' training to the end, its steps shown as a progress bar."""
    steps = folder / "progress.json"
    with watch(
        lambda: read_steps(steps)[0], lambda: read_steps(steps)[1], desc="train", unit="step"
    ) as bar:
        env = {**train_env(store), PROGRESS_FILE_ENV: str(steps)}
        run_logged(cmd, folder / "train.log", TrainError, "speculators training", env=env)
        if bar.total:  # the steps after the last logged one
            bar.update(bar.total - bar.n)


def drafter_outputs(
    drafter: Path,
    config: dict[str, Any],
    steps: Path,
    cmd: list[str],
    verifier: VerifierOutputs,
    extract: ExtractOutputs,
    tokens_generated_online: int,
    chat_template_sha256: str,
) -> TrainOutputs:
    state_path, metrics_path = drafter / "training_state.json", drafter / "val_metrics.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    reported = trainer_state(steps)
    return TrainOutputs(
        drafter=str(drafter),
        checkpoint=drafter.name,
        drafter_sha256=drafter_digest(drafter),
        global_steps=state.get("global_step") or reported.get("total_steps"),
        val_metrics=json.loads(metrics_path.read_text()) if metrics_path.exists() else None,
        draft_vocab_size=config["draft_vocab_size"],
        device="cpu" if serving_platform() == "cpu" else "accelerator",
        # As the ranks themselves saw it: whether a process group was formed, of how many ranks.
        distributed=reported.get("distributed"),
        world_size=reported.get("world_size"),
        command=cmd,
        hidden_states={
            "mode": extract.mode,
            "dtype": extract.dtype,
            "tokens_generated_online": tokens_generated_online,
        },
        verifier={
            "model": verifier.model,
            "capture_layer_ids": extract.captured_layer_ids[:-1],
            "chat_template_sha256": chat_template_sha256,
        },
    )


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    check_fabric(profile.train)  # a fabric interface this machine lacks fails before anything
    verifier = read_input(profile, "train", "verifier").outputs
    extract = read_input(profile, "train", "extract")
    # The aux layers extraction captured (it also records the last, which speculators appends).
    layers = extract.outputs.captured_layer_ids[:-1]
    folder = stage_dir(profile, "train")
    # Another node than 0 works in a folder of its own (views, staging, log) beside node 0's;
    # the checkpoints are shared, written by speculators' global rank 0, on node 0.
    node = profile.train.nodes.rank if profile.train.nodes else 0
    work = folder / f"node{node}" if node else folder
    work.mkdir(parents=True, exist_ok=True)
    prepared = work / "data"  # speculators writes the draft-vocabulary maps here
    used = training_view(
        stage_dir(profile, "extract") / extract.outputs.prepared,
        prepared,
        profile.train.train_data_ratio,
        profile.train.max_train_tokens,
    )
    save = folder / "checkpoints"
    # speculators gets the verifier's text model when it is a multimodal wrapper (Kimi-K2.5)
    as_text = text_view(verifier.model, verifier.revision, work / "verifier-text")
    own_config = verifier_config(verifier.model, verifier.revision)
    pretrained = None
    if profile.train.from_pretrained:  # checked and prepared before anything starts
        pretrained = start_from(profile.train.from_pretrained, own_config, as_text, layers, work)
    with contextlib.ExitStack() as stack:
        online = None
        if extract.outputs.mode == "online":
            online = extraction_server(profile, verifier.model, work, stack, as_text)
        fp8 = extract.outputs.dtype == "float8_e4m3fn"
        online_v1 = online.v1 if online else None
        store = rendezvous(profile.train)  # its port picked just before the ranks start
        cmd = train_command(
            profile, as_text, prepared, save, layers, online_v1, fp8, pretrained, store,
            train_data_ratio=used.train_data_ratio,
        )  # fmt: skip
        run_trainer(work, cmd, store)
        # Tokens the extraction server ran for training: the measured cost of online mode.
        generated_tokens = int(scrape(online.base_url).prompt_tokens) if online else 0
    if node:  # node 0 holds the checkpoints and writes the record
        log.info("train: node %d done; node 0 writes the manifest", node)
        return {"stage": "train", "node_rank": node}
    drafter, config = checked_drafter(save, layers)
    # The template the extraction server applied (extract's, or this stage's own when online):
    # the verifier's, or a --chat-template in server.extra_args; eval serves the same or refuses.
    extraction_args = (
        profile.server.extra_args if online else extract.config["server"].get("extra_args", [])
    )
    template_sha = served_chat_template_sha256(extraction_args, verifier.chat_template_sha256)
    name_verifier(drafter, verifier.model, own_config)
    portable_drafter(profile, drafter)  # published as evaluated: no path of this machine
    outputs = drafter_outputs(
        drafter, config, folder / "progress.json", cmd, verifier, extract.outputs,
        generated_tokens, template_sha,
    )  # fmt: skip
    outputs.training_data = used.record()
    if pretrained:
        outputs.from_pretrained = pretrained.record
    if store:
        outputs.rendezvous = store.record()
    return write_manifest(
        profile,
        "train",
        started_at=started,
        counts=all_succeeded(extract.outputs.rows),
        outputs=outputs,
        data_revision=extract.data_revision,
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("train", run, argv)


if __name__ == "__main__":
    main()
