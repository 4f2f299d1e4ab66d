"""GPU smoke: a hidden-state capture and a few drafter training steps on a CUDA device, over a
finished run's data; skipped cleanly (exit 0, one line) when no device is visible.

What it checks that a CPU run cannot:
1. capture: the verifier, loaded with transformers on the device, recomputes the EAGLE-3
   hidden states of the first ``--shards`` extracted rows at the captured layers (layer id i
   is the input of decoder layer i; id == num_hidden_layers is the last layer's output before
   the final norm, as vLLM's extract_hidden_states captures them). They must agree with the
   shards extract stored (cosine similarity per token), and once written through extract's own
   shard writer (atomic, within the disk reserve) they must read back bit for bit;
2. training: speculators trains the drafter for one epoch on ``--rows`` of the extracted rows
   with the GPU kernels (flex attention, fused loss), through the same launcher and command
   line as the train stage, and writes a checkpoint whose config names the capture layers.

Inputs: the run's ``verifier`` and ``extract`` stages (``make demo`` for the tiny profile).
Output: ``runs/<name>/gpu-smoke/`` (report.json, the trainer's log and checkpoint), rewritten
on every run. ``--allow-cpu`` runs the same path on the CPU with the profile's kernels, for
tests of this script on machines without a device.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.cli import report, stage_parser
from pipeline.core.config import Profile, load_profile
from pipeline.core.contracts import ExtractOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import hardware, now, stage_dir, stage_manifest
from pipeline.serving.extraction import reserve_bytes
from pipeline.serving.logged_process import run_logged
from pipeline.training.launch import (
    checked_drafter,
    read_steps,
    rendezvous,
    train_command,
    train_env,
)
from pipeline.training.speculators_train import PROGRESS_FILE_ENV
from pipeline.training.text_view import text_model, text_view

log = logging.getLogger(__name__)
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99, "float16": 0.995}
GPU_KERNELS = ["train.draft_attn_impl=simple_flex_attention", "train.loss_implementation=fused"]


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
    from pipeline.serving.hidden_states_connector import write_shard  # imports vLLM: not for a skip

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
    out.mkdir(parents=True, exist_ok=True)
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


def training_subset(prepared: Path, rows: int, view: Path) -> Path:
    """The first ``rows`` extracted rows as a dataset folder of their own, linking the shards."""
    import datasets

    table = datasets.load_from_disk(str(prepared))
    table.select(range(min(rows, len(table)))).save_to_disk(str(view))
    for name in ("hidden_states", "token_freq.pt"):
        (view / name).symlink_to((prepared / name).resolve())
    return view


def train_steps(profile: Profile, extract: ExtractOutputs, rows: int, out: Path) -> dict[str, Any]:
    view = training_subset(prepared_dir(profile, extract), rows, out / "data")
    save = out / "checkpoints"
    verifier = stage_manifest(profile, "verifier").outputs
    as_text = text_view(verifier.model, verifier.revision, out / "verifier-text")
    layers = extract.captured_layer_ids[:-1]
    store = rendezvous(profile.train.model_copy(update={"nodes": None}))  # this machine alone
    cmd = train_command(profile, as_text, view, save, layers, store=store)
    steps = out / "progress.json"
    env = {**train_env(store), PROGRESS_FILE_ENV: str(steps)}
    run_logged(cmd, out / "train.log", GpuSmokeError, "speculators training", env=env)
    drafter, _ = checked_drafter(save, layers)
    done, total = read_steps(steps)
    if not done:
        raise GpuSmokeError(f"speculators reported no training step; log {out / 'train.log'}")
    return {
        "rows": rows,
        "checkpoint": str(drafter),
        "global_steps": done,
        "total_steps": total,
        "draft_attn_impl": profile.train.draft_attn_impl,
        "loss_implementation": profile.train.loss_implementation,
        "command": cmd,
    }


def run(profile: Profile, device: str, shards: int, rows: int) -> dict[str, Any]:
    started = now()
    out = profile.run.run_dir / "gpu-smoke"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    extract = stage_manifest(profile, "extract").outputs
    result = {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "capture": check_capture(profile, extract, device, shards, out / "hidden_states"),
        "train": train_steps(profile, extract, rows, out),
        "hardware": hardware(),
        "started_at": started.isoformat(),
        "finished_at": now().isoformat(),
    }
    atomic_write_json(out / "report.json", result)
    log.info(
        "gpu-smoke passed on %s: hidden states min cosine %.6f over %d shards; %s steps",
        result["device_name"],
        result["capture"]["min_cosine"],
        len(result["capture"]["shards"]),
        result["train"]["global_steps"],
    )
    return {"stage": "gpu-smoke", "counts": {"shards": len(result["capture"]["shards"])}}


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser("gpu-smoke")
    parser.add_argument("--shards", type=int, default=8, help="rows whose capture is compared")
    parser.add_argument("--rows", type=int, default=64, help="rows trained on for one epoch")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU without a GPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"gpu-smoke: skipped: no CUDA device visible (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda})")  # fmt: skip
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = [*args.overrides, "train.epochs=1", "train.log_every=1"]
    if device == "cuda":
        overrides += GPU_KERNELS
    report(lambda: run(load_profile(args.config, overrides), device, args.shards, args.rows))


if __name__ == "__main__":
    main()
