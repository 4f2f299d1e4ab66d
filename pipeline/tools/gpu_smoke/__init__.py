"""`make gpu-smoke`: the first GPU hour's script, one JSON report, from a fresh clone.

Run as: python -m pipeline.tools.gpu_smoke [--out runs/gpu-smoke] [section.field=value ...]

Phases, each recorded in ``<out>/report.json`` with its wall time (the report is rewritten after
every phase, so a phase that fails leaves what came before it):

1. ``torch`` (torch alone): the device and its capability; a bf16 matrix product against a
   float64 one; flex attention (compiled on CUDA) against SDPA, causal, forward and backward;
   a safetensors round trip from device memory where safetensors is installed.
2. ``pipeline`` (the GPU venv, ``make venv TARGET=gpu``): the tiny-gpu profile end to end,
   smoke-sized (:mod:`.pipeline_phase`): the miniature built, served by CUDA
   vLLM with TRITON_MLA and CUDA graphs, hidden states captured, a drafter trained with flex
   attention and the fused loss, eval serving it with EAGLE-3 and ngram beside the baseline.
3. ``checks`` over that run: the capture against transformers on the device, the trainer's
   steps and kernels, greedy losslessness and accepted drafts, the servers' backend and graphs.

On a CUDA machine with torch but without vLLM, speculators or transformers (a bare Python 3.12
with torch, no network), phase 1 runs and phases 2 and 3 are reported as skipped, naming the
missing package; the exit status is 0. Without a CUDA device nothing runs (exit 0, one line),
unless ``--allow-cpu``, which runs the same phases on the CPU with configs/tiny.yaml (the tests
do). A failed check exits 2 with one line naming it.

Invariant: this module imports only the standard library and torch at its top, so that phase 1
needs nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("torch", "pipeline", "checks")
NEEDS = {"pipeline": ("vllm", "speculators", "transformers", "pydantic", "yaml")}
NEEDS["checks"] = NEEDS["pipeline"]
# bf16 keeps 8 bits of mantissa: a 512-term product of unit normals lands about 0.3% from
# float64 (measured 0.29% on a 2-core CPU, torch 2.13.0); 2% leaves room for a device's own
# accumulation. Flex attention against SDPA, relative to the largest value: float32 agrees to
# rounding (measured 1.8e-7 on the CPU); bf16 allows a few of its 2**-8 steps.
MAX_BF16_MATMUL_REL_ERROR = 0.02
MAX_FLEX_VS_SDPA = {"float32": 1e-5, "bfloat16": 2e-2}  # of the largest value


class SmokeFailed(Exception):
    """A check failed; the message names it and what was measured."""


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".report.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, out / "report.json")


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False


def missing(phase: str) -> list[str]:
    return [name for name in NEEDS.get(phase, ()) if not installed(name)]


def torch_checks(device: str) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        found["device_name"] = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        found["capability"] = f"sm_{major}{minor}"
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=gen, dtype=torch.float64) for _ in range(2))
    exact = a @ b
    got = (a.to(device, torch.bfloat16) @ b.to(device, torch.bfloat16)).double().cpu()
    rel = float((got - exact).norm() / exact.norm())
    found["bf16_matmul_rel_error"] = rel
    if rel > MAX_BF16_MATMUL_REL_ERROR:
        raise SmokeFailed(f"bf16 matmul on {device}: relative error {rel:.4f} > "
                          f"{MAX_BF16_MATMUL_REL_ERROR}")  # fmt: skip
    found["flex_attention"] = flex_vs_sdpa(device)
    with contextlib.suppress(ImportError):
        from safetensors.torch import load_file, save_file

        with tempfile.TemporaryDirectory() as tmp:
            tensor = torch.randn(64, 128, generator=gen).to(device, torch.bfloat16)
            save_file({"hidden_states": tensor}, f"{tmp}/x.safetensors")
            back = load_file(f"{tmp}/x.safetensors", device=device)["hidden_states"]
            if not torch.equal(back, tensor):
                raise SmokeFailed(f"safetensors on {device}: bf16 tensor read back differs")
        found["safetensors_round_trip"] = True
    return found


def flex_vs_sdpa(device: str) -> dict[str, Any]:
    """speculators' flex-attention kernel path against SDPA, causal: forward, and on CUDA
    backward too (torch's flex attention has no backward on the CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 256, 64, generator=gen).to(device, dtype).requires_grad_(cuda)
               for _ in range(3))  # fmt: skip
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, device=device)
    attend = torch.compile(flex_attention) if cuda else flex_attention
    flex = attend(q, k, v, block_mask=mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pairs = [(flex, sdpa)]
    if cuda:
        pairs += zip(torch.autograd.grad(flex.sum(), (q, k, v)),
                     torch.autograd.grad(sdpa.sum(), (q, k, v)), strict=True)  # fmt: skip
    # Relative to each tensor's largest value: bf16's spacing grows with magnitude (causal dV
    # reaches about 6 here, where one bf16 step is 0.03).
    differences = [float((a - b).abs().max() / b.abs().max()) for a, b in pairs]
    worst = max(differences)
    limit = MAX_FLEX_VS_SDPA[str(dtype).removeprefix("torch.")]
    if worst > limit:
        raise SmokeFailed(f"flex attention on {device} differs from SDPA by {worst:.2e} of the "
                          f"largest value > {limit}")  # fmt: skip
    return {"dtype": str(dtype), "compiled": cuda, "backward": cuda, "max_rel_difference": worst}


def run_phase(name: str, args: argparse.Namespace, device: str, report: dict[str, Any]) -> None:
    started = time.monotonic()
    if lacking := missing(name):
        report["phases"][name] = {"skipped": f"needs {', '.join(lacking)} (make venv TARGET=gpu)"}
        return
    config = args.config or ("configs/tiny-gpu.yaml" if device == "cuda" else "configs/tiny.yaml")
    if name == "torch":
        result = torch_checks(device)
    elif name == "pipeline":
        from pipeline.tools.gpu_smoke import pipeline_phase

        result = pipeline_phase.run_pipeline(config, args.overrides, args.out,
                                                 args.stage_timeout_s)  # fmt: skip
    else:
        from pipeline.tools.gpu_smoke import pipeline_phase

        result = pipeline_phase.run_checks(config, args.overrides, args.out, device,
                                               args.shards)  # fmt: skip
    report["phases"][name] = {**result, "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpu-smoke", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        default=None,
        help="default configs/tiny-gpu.yaml (configs/tiny.yaml with --allow-cpu)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/gpu-smoke"),
        help="the smoke's run folder, report.json in it",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="of torch,pipeline,checks")
    parser.add_argument("--shards", type=int, default=8, help="rows whose capture is compared")
    parser.add_argument("--stage-timeout-s", type=float, default=900)
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU without a GPU")
    parser.add_argument("overrides", nargs="*", help="section.field=value for the pipeline")
    args = parser.parse_args(argv)  # fmt: skip
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"--phases: unknown {sorted(unknown)}; phases are {', '.join(PHASES)}")
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"gpu-smoke: skipped: no CUDA device visible (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda})")  # fmt: skip
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"device": device, "python": platform.python_version(),
                              "started_at": now(), "phases": {}}  # fmt: skip
    try:
        for name in phases:
            run_phase(name, args, device, report)
            write_report(args.out, report)
    except Exception as err:
        report["failed"] = f"{type(err).__name__}: {err}"
        report["finished_at"] = now()
        write_report(args.out, report)
        # A finding is a SmokeFailed or one of the pipeline's errors (a PipelineError, known by
        # name: importing it would import what phase 1 runs without); anything else is a bug.
        finding = {c.__name__ for c in type(err).__mro__} & {"SmokeFailed", "PipelineError"}
        if not finding:
            raise
        print(f"error: gpu-smoke: {err}\nreport: {args.out / 'report.json'}", file=sys.stderr)
        sys.exit(2)
    report["finished_at"] = now()
    write_report(args.out, report)
    skipped = [n for n, p in report["phases"].items() if "skipped" in p]
    print(f"gpu-smoke passed on {device}: {', '.join(n for n in phases if n not in skipped)}"
          + (f"; skipped {', '.join(skipped)} ({report['phases'][skipped[0]]['skipped']})"
             if skipped else "") + f"; report {args.out / 'report.json'}")  # fmt: skip


if __name__ == "__main__":
    main()
