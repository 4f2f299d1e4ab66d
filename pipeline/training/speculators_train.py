"""Entry point for speculators' EAGLE-3 trainer, on GPUs as it is and on CPU-only machines.

Run as: python -m pipeline.training.speculators_train <speculators train flags>
   or:  python -m pipeline.training.ranks --nproc-per-node N --store 127.0.0.1:PORT \
            -m pipeline.training.speculators_train <flags>

speculators 0.9.0's trainer assumes an accelerator. When ``torch.accelerator`` reports none,
:func:`adapt_to_cpu` applies the smallest run-time patches that point it at the CPU; with an
accelerator it changes nothing. Each patch names the speculators internal it replaces, and
:func:`check_patch_targets` fails loudly (before any patching) when a speculators upgrade has
moved one, rather than letting training silently run the unpatched code.

When ``TRAIN_PROGRESS_FILE`` is set, rank 0 also keeps that file (JSON ``global_step``,
``total_steps``, whether it runs distributed and its ``world_size``, replaced atomically at
every logged step) so that the `train` stage, which runs this as a subprocess with its output in
a log, can show a bar with rate and ETA.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# (module, attribute) pairs that adapt_to_cpu replaces.
PATCH_TARGETS = (
    ("speculators.train.trainer", "get_local_rank"),
    ("speculators.train.trainer", "_StepTimer"),
    ("speculators.train.checkpointer", "get_current_device"),
    ("speculators.train.cli", "maybe_setup_distributed"),
    ("speculators.train.cli", "build_draft_model"),
    ("speculators.train.distributed", "_init_sp_process_groups"),
)


class SpeculatorsAdapterError(RuntimeError):
    """speculators changed under the CPU adapter; update pipeline/training/speculators_train.py."""


def check_patch_targets() -> None:
    for module_name, dotted in PATCH_TARGETS:
        obj = importlib.import_module(module_name)
        for part in dotted.split("."):
            if not hasattr(obj, part):
                raise SpeculatorsAdapterError(
                    f"{module_name}.{dotted} no longer exists in this speculators version; "
                    "the CPU adapter in pipeline/training/speculators_train.py must be updated"
                )
            obj = getattr(obj, part)
    from speculators.train.trainer import Trainer

    # device_type is an instance attribute set in Trainer.__init__, shadowed by a property here.
    if "self.device_type =" not in inspect.getsource(Trainer.__init__):
        raise SpeculatorsAdapterError(
            "speculators' Trainer.__init__ no longer sets self.device_type; "
            "the CPU adapter in pipeline/training/speculators_train.py must be updated"
        )


def adapt_to_cpu() -> bool:
    """Patch speculators' trainer for a machine without an accelerator; True if patched."""
    if torch.accelerator.is_available():
        return False
    check_patch_targets()
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as train_cli
    import speculators.train.distributed as sdist
    import speculators.train.trainer as trainer

    # The local rank doubles as the device (`model.to(self.local_rank)`); 0 means accelerator 0.
    trainer.get_local_rank = lambda: "cpu"
    # Autocast is opened for "cuda" when no accelerator exists, i.e. disabled; bf16 batches would
    # then meet fp32 weights. CPU autocast reconciles them.
    trainer.Trainer.device_type = property(lambda self: "cpu", lambda self, value: None)
    # The step timer synchronises the accelerator on every logged step.
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    # Resume loads checkpoints onto get_current_device(), "cuda:0" without an accelerator.
    checkpointer.get_current_device = lambda: "cpu"

    # Several ranks: the stock set-up selects the accelerator's backend and device index; use
    # gloo. Its env:// rendezvous reaches the store pipeline.training.ranks hosts.
    def maybe_setup_distributed(sp_size: int = 1) -> None:
        sdist._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        sdist._is_distributed = "LOCAL_RANK" in os.environ
        if not sdist._is_distributed:
            return
        dist.init_process_group("gloo")
        sdist._rank, sdist._world_size = dist.get_rank(), dist.get_world_size()
        sdist._init_sp_process_groups(sdist._rank, sdist._world_size, sp_size)

    train_cli.maybe_setup_distributed = maybe_setup_distributed
    # Checkpoints are written in bf16; --from-pretrained would load bf16 master weights that CPU
    # (without fp32 autocast) cannot mix with fp32 batches. The trainer intends fp32 masters.
    build = train_cli.build_draft_model
    train_cli.build_draft_model = lambda *args, **kwargs: build(*args, **kwargs).float()
    return True


PROGRESS_FILE_ENV = "TRAIN_PROGRESS_FILE"
METRICS_LOGGER = "speculators.metrics"  # speculators logs a dict per logged step here


class StepFileHandler(logging.Handler):
    """Writes the trainer's global step and the run's total steps to a small JSON file."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.total_steps: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != METRICS_LOGGER or not isinstance(record.msg, dict):
            return
        if "train" not in record.msg:  # a validation record, without a step
            return
        done = record.msg["global_step"] + 1
        if self.total_steps is not None:  # a partial last batch can add a step to the count
            done = min(done, self.total_steps)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        distributed = dist.is_initialized()
        state = {
            "global_step": done,
            "total_steps": self.total_steps,
            "distributed": distributed,
            "world_size": dist.get_world_size() if distributed else 1,
        }
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)


def batches_per_epoch(loader, epochs: int) -> list[int]:
    """The batches of each epoch: a packing sampler draws a different number every epoch."""
    sampler = loader.batch_sampler
    if not hasattr(sampler, "set_epoch"):
        return [len(loader)] * epochs
    first = getattr(sampler, "epoch", 0)
    counts = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        counts.append(len(loader))
    sampler.set_epoch(first)
    return counts


def report_steps(path: Path) -> None:
    """Keep ``path`` up to date from speculators' metric records (rank 0 only)."""
    if os.environ.get("RANK", "0") != "0":
        return
    from speculators.train.trainer import Trainer

    handler = StepFileHandler(path)
    init = Trainer.__init__

    def init_and_count_steps(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        total = sum(batches_per_epoch(self.train_loader, self.config.num_epochs))
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        handler.total_steps = total

    Trainer.__init__ = init_and_count_steps
    # On the root logger: speculators' dictConfig replaces the handlers of its own loggers.
    logging.getLogger().addHandler(handler)


def main(argv: list[str] | None = None) -> None:
    adapt_to_cpu()
    if os.environ.get(PROGRESS_FILE_ENV):
        report_steps(Path(os.environ[PROGRESS_FILE_ENV]))
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
