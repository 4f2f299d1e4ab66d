"""gpu-smoke's pipeline phase: the tiny profile run end to end on CUDA vLLM, then checked.

Needs the whole install (make venv TARGET=gpu): vLLM, speculators, transformers. Imported by
:mod:`pipeline.tools.gpu_smoke` only once its torch-only phase has passed and these packages
import, so that a bare CUDA machine runs that phase without them.

1. run: the stages (verifier, generate, licenses, extract, train, eval), each as ``make`` runs
   it, on ``configs/tiny-gpu.yaml`` (CUDA) or ``configs/tiny.yaml`` (``--allow-cpu``) with
   :data:`SMOKE_OVERRIDES`: the miniature built and served by CUDA vLLM with its MLA backend and
   CUDA graphs, hidden states captured, a drafter trained with flex attention and the fused
   loss for at most :data:`TRAIN_STEPS` steps, eval serving it with EAGLE-3 and ngram beside the
   baseline. The run is the smoke's folder (``--out``); each stage's log is in its
   ``smoke-logs/<stage>.log``.
2. checks over that run:
   - capture: the verifier, loaded with transformers on the device, recomputes the EAGLE-3
     hidden states of the first extracted rows at the captured layers (layer id i is the input
     of decoder layer i; id == num_hidden_layers is the last layer's output before the final
     norm, as vLLM's extract_hidden_states captures them); they must agree with the stored
     shards (cosine per token), and written through extract's own shard writer they must read
     back bit for bit;
   - training: the trainer's steps and kernels, from the train stage's manifest;
   - decoding: eval's own comparison says greedy outputs are identical with and without each
     drafter, and both EAGLE-3 and ngram drafts are accepted (mean acceptance length above 1);
   - serving: the attention backend and CUDA-graph lines of the servers' logs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline.core.config import Profile, load_profile
from pipeline.core.contracts import ExtractOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import stage_dir, stage_manifest
from pipeline.core.portable import REPO_ROOT
from pipeline.serving.extraction import reserve_bytes
from pipeline.training.text_view import text_model

log = logging.getLogger(__name__)
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99, "float16": 0.995}
TRAIN_STEPS = 300
# The smallest run that still shows each check: 128 prompts (about 300 training steps over ten
# epochs), one k, batch size 1, 16 eval prompts of 64 tokens.
SMOKE_OVERRIDES = [
    "data.max_samples=128",
    f"train.max_steps={TRAIN_STEPS}",
    "eval.num_speculative_tokens=[3]",
    "eval.methods=[ngram, eagle3]",
    "eval.concurrency=[1]",
    "data.eval_max_samples=16",
    "eval.max_tokens=64",
]
STAGES = [
    ("verifier", "pipeline.verifier"),
    ("generate", "pipeline.generate"),
    ("licenses", "release.licenses"),
    ("extract", "pipeline.extract"),
    ("train", "pipeline.train"),
    ("eval", "eval"),
]


class GpuSmokeError(PipelineError):
    """The device computed something the pipeline cannot use; the message says what."""


def prepared_dir(profile: Profile, extract: ExtractOutputs) -> Path:
    return stage_dir(profile, "extract") / extract.prepared


def captured_hidden_states(model, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[num_tokens, len(layer_ids), hidden] at the captured layers, as vLLM captures them."""
    pre_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    try:
        with torch.no_grad():
            out = model(token_ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    n = model.config.num_hidden_layers
    layers = [pre_norm[0] if i == n else out.hidden_states[i] for i in layer_ids]
    return torch.stack([h[0] for h in layers], dim=1)


def check_capture(
    profile: Profile, extract: ExtractOutputs, device: str, shards: int, out: Path
) -> dict[str, Any]:
    """``extract``: the extract stage's outputs (its manifest)."""
    from pipeline.serving.hidden_states_connector import write_shard

    if extract.dtype == "float8_e4m3fn":
        raise GpuSmokeError("the smoke compares against unquantised shards: extract with "
                            "extract.hidden_states_format=verifier_dtype")  # fmt: skip
    hs_dir = prepared_dir(profile, extract) / "hidden_states"
    dtype = getattr(torch, profile.verifier.dtype)
    verifier = stage_manifest(profile, "verifier").outputs
    model = text_model(
        verifier.model,
        verifier.revision,
        out.parent / "verifier-text",
        dtype=dtype,
        trust_remote_code=profile.verifier.trust_remote_code,
    )
    model = model.to(device)
    floor = MIN_COSINE[profile.verifier.dtype]
    rows, worst = [], 1.0
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for i in range(shards):
        path = hs_dir / f"hs_{i}.safetensors"
        if not path.exists():
            break
        stored = load_file(path)
        got = captured_hidden_states(
            model, stored["token_ids"].to(device), extract.captured_layer_ids
        ).cpu()
        if got.shape != stored["hidden_states"].shape:
            raise GpuSmokeError(f"{path}: shape {tuple(got.shape)} on {device}, stored "
                                f"{tuple(stored['hidden_states'].shape)}")  # fmt: skip
        cosine = torch.nn.functional.cosine_similarity(
            got.float(), stored["hidden_states"].float(), dim=-1
        )
        row_min = float(cosine.min())
        worst = min(worst, row_min)
        written = out / path.name
        tensors = {"hidden_states": got.contiguous(), "token_ids": stored["token_ids"]}
        if not write_shard(tensors, str(written), reserve_bytes(profile)):
            raise GpuSmokeError(f"the shard writer refused {written} (disk reserve or NaN)")
        back = load_file(written)
        if not torch.equal(back["hidden_states"], tensors["hidden_states"]):
            raise GpuSmokeError(f"{written} does not read back as written")
        rows.append({"shard": path.name, "tokens": int(got.shape[0]), "min_cosine": row_min})
    if not rows:
        raise GpuSmokeError(f"no hidden-state shards under {hs_dir}; run `make extract` first")
    if worst < floor:
        raise GpuSmokeError(
            f"hidden states on {device} differ from the stored ones: min cosine {worst:.6f} < "
            f"{floor} for {profile.verifier.dtype}; the device or its kernels compute another model"
        )
    return {"shards": rows, "min_cosine": worst, "threshold": floor}


def run_stages(config: str, overrides: list[str], out: Path, timeout_s: float) -> list[dict]:
    """Each stage as make runs it, in a session of its own, logged to ``out/<stage>.log`` and
    timed; stops at the first that fails or outlives ``timeout_s`` (its whole process group,
    vLLM included, killed), naming it with its log's tail."""
    ran = []
    for name, module in STAGES:
        cmd = [sys.executable, "-m", module, "--config", config, *overrides]
        log_path = out / f"{name}.log"
        started = time.monotonic()
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                returncode = proc.wait(timeout=timeout_s)
            except BaseException:  # the timeout, Ctrl-C: nothing of the stage stays
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            finally:
                wall_s = round(time.monotonic() - started, 1)
        ran.append({"stage": name, "returncode": returncode, "wall_s": wall_s})
        if returncode != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-40:]
            raise GpuSmokeError(f"stage {name} failed (exit {returncode}); {log_path}:\n"
                                + "\n".join(tail))  # fmt: skip
    return ran


def check_training(profile: Profile) -> dict[str, Any]:
    train = stage_manifest(profile, "train").outputs
    cmd = train.command
    kernels = {flag: cmd[cmd.index(flag) + 1] for flag in ("--draft-attn-impl",
               "--loss-implementation") if flag in cmd}  # fmt: skip
    if not train.global_steps:
        raise GpuSmokeError("speculators reported no training step: see train.log")
    return {"global_steps": train.global_steps, "device": train.device, "kernels": kernels,
            "val_metrics": train.val_metrics}  # fmt: skip


def check_decoding(profile: Profile) -> dict[str, Any]:
    """Eval's own comparisons: every arm's greedy outputs against the baseline's, level by level,
    and drafts accepted by EAGLE-3 and ngram."""
    summary = stage_manifest(profile, "eval").outputs.summary
    results = json.loads((stage_dir(profile, "eval") / "results.json").read_text())
    mismatched = {
        f"{run['series']} k={run.get('k')} c={level['concurrency']}": level["mismatched_prompt_ids"]
        for run in results["runs"]
        for level in run["levels"]
        if "mismatched_prompt_ids" in level
    }
    found = {
        "arms_compared": len(mismatched),
        "greedy_outputs_identical": not any(mismatched.values()),
        "eagle3_mean_acceptance_length": summary.get("mean_acceptance_length"),
        "ngram_mean_acceptance_length": summary.get("ngram_mean_acceptance_length"),
        "speedup": summary.get("speedup"),
        "num_speculative_tokens": summary.get("num_speculative_tokens"),
    }
    if not mismatched or not found["greedy_outputs_identical"]:
        bad = {arm: ids for arm, ids in mismatched.items() if ids}
        raise GpuSmokeError(
            f"greedy outputs differ from the baseline's: {bad or 'no arm compared'}"
        )
    for method in ("eagle3", "ngram"):
        length = found[f"{method}_mean_acceptance_length"]
        if not length or length <= 1:
            raise GpuSmokeError(f"{method} drafts were not accepted (mean acceptance length "
                                f"{length}): see eval.log and eval/vllm-*.log")  # fmt: skip
    return found


BACKEND_LINE = re.compile(r"Using (?:\w+\.)?(\w+) backend")
GRAPH_LINE = re.compile(r"Graph capturing finished in \d+ secs")


def server_log_findings(profile: Profile) -> dict[str, Any]:
    """What each eval server's log says of its attention backend and CUDA graphs."""
    found = {}
    for log_path in sorted((stage_dir(profile, "eval")).glob("vllm-*.log")):
        text = log_path.read_text(errors="replace")
        found[log_path.name] = {
            "attention_backends": sorted(set(BACKEND_LINE.findall(text))),
            "cuda_graphs_captured": bool(GRAPH_LINE.search(text)),
        }
    return found


def profile_for(config: str, overrides: list[str], out: Path) -> tuple[list[str], Profile]:
    """The smoke's overrides and profile: its run is the folder ``out``."""
    run = [f"run.output_dir={out.parent}", f"run.name={out.name}"]
    overrides = [*SMOKE_OVERRIDES, *overrides, *run]
    return overrides, load_profile(config, overrides)


def run_pipeline(config: str, overrides: list[str], out: Path, stage_timeout_s: float) -> dict:
    """The stages on the smoke's profile, from nothing (what a finished stage left is reused)."""
    overrides, _ = profile_for(config, overrides, out)
    logs = out / "smoke-logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        stages = run_stages(config, overrides, logs, stage_timeout_s)
    except subprocess.TimeoutExpired as err:
        raise GpuSmokeError(f"a stage outlived --stage-timeout-s={stage_timeout_s:.0f}: {err.cmd}"
                            f"; its log is in {logs}") from None  # fmt: skip
    return {"config": config, "overrides": overrides, "stages": stages}


def run_checks(config: str, overrides: list[str], out: Path, device: str, shards: int) -> dict:
    """The checks over the smoke's run (``out``)."""
    _, profile = profile_for(config, overrides, out)
    extract = stage_manifest(profile, "extract").outputs
    result = {
        "capture": check_capture(profile, extract, device, shards, out / "smoke-capture"),
        "training": check_training(profile),
        "decoding": check_decoding(profile),
        "servers": server_log_findings(profile),
    }
    if device == "cuda":
        check_servers(profile, result["servers"])
    return result


def check_servers(profile: Profile, servers: dict[str, Any]) -> None:
    """On CUDA: every eval server named the profile's attention backend (when it names one)
    and captured CUDA graphs (unless server.enforce_eager)."""
    if not servers:
        raise GpuSmokeError("no eval server log (eval/vllm-*.log) to read")
    backend = profile.server.attention_backend
    for name, seen in servers.items():
        if backend and backend not in seen["attention_backends"]:
            raise GpuSmokeError(f"{name}: the {backend} backend was asked for, the log shows "
                                f"{seen['attention_backends'] or 'none'}")  # fmt: skip
        if not profile.server.enforce_eager and not seen["cuda_graphs_captured"]:
            raise GpuSmokeError(f"{name}: no CUDA graphs captured (server.enforce_eager is off)")
