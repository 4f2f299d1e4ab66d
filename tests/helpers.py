"""Helpers shared by the tests: real small filesystems, seeded run folders, loopback servers."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin

import psutil
import pytest
from aiohttp import web

from pipeline.core.config import Profile
from pipeline.core.contracts import CONTRACTS, Manifest, Outputs
from pipeline.core.manifest import read_manifest
from pipeline.serving.vllm_api import LOOPBACK, free_port

REPO = Path(__file__).parent.parent


def in_ci() -> bool:
    """Whether CI runs these tests: ``CI`` set to anything but empty, 0, false or no (CI services
    set ``true``, some ``1``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_unless_ci(why: str) -> NoReturn:
    """Skip with ``why`` on a developer's machine; fail with it under CI, which must run every
    test of its tier (a skip there would hide a test that never ran)."""
    if in_ci():
        pytest.fail(f"{why} (CI runs this test, so it fails rather than skips)")
    pytest.skip(why)


# The demo's training data; fewer, shorter eval prompts keep the default test run in budget.
TEST_OVERRIDES = [
    "data.eval_max_samples=24",
    "eval.max_tokens=64",
]


@contextlib.contextmanager
def small_volume(path: Path, size_bytes: int):
    """A real filesystem of ``size_bytes`` (tmpfs) at ``path``, so a write can hit ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode:
        skip_unless_ci(
            f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {mount.stderr.strip()}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_volume(path: Path, leave_bytes: int) -> Path:
    """Write a ballast file that leaves at most ``leave_bytes`` free on ``path``'s volume."""
    ballast = path / "ballast.bin"
    size = max(shutil.disk_usage(path).free - leave_bytes, 0)
    chunk = b"\0" * 2**20
    with open(ballast, "wb", buffering=0) as fh:
        try:
            while size > 0:
                size -= fh.write(chunk[: min(size, len(chunk))])
        except OSError as err:  # others wrote meanwhile: the volume is full, as wanted
            if err.errno != errno.ENOSPC:
                raise
    return ballast


def seed_run_dir(source: Profile, target: Profile, stages: tuple[str, ...]) -> None:
    """Declare ``stages`` of ``source``'s run finished in ``target``'s run folder (by copy)."""
    for stage in stages:
        shutil.copytree(
            source.run.run_dir / stage,
            target.run.run_dir / stage,
            ignore=shutil.ignore_patterns("model", "*.log"),
        )
        model = source.run.run_dir / stage / "model"
        if model.is_dir():  # used in place; manifests name it relative to the run folder
            (target.run.run_dir / stage / "model").symlink_to(model.absolute())


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free port of 127.0.0.1; yield its base url."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port(LOOPBACK)
    await web.TCPSite(runner, LOOPBACK, port).start()
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        await runner.cleanup()


def stage_command(module: str, *args: str) -> list[str]:
    """``python -m <module> --config configs/tiny.yaml <args>``, as make runs it."""
    return [sys.executable, "-m", module, "--config", "configs/tiny.yaml", *args]


def stage_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A stage's environment in the tests: the repository importable, no progress bars."""
    return {**os.environ, "PYTHONPATH": str(REPO), "PROGRESS": "0", **(env or {})}


def run_stage(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """A stage run in the repository, as make runs it (no progress bars); its exit status and
    output are the caller's to check."""
    return subprocess.run(
        stage_command(module, *args),
        cwd=REPO,
        env=stage_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def alive_after(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those of ``procs`` still alive (zombies count as gone) after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def verifier_model(profile: Profile) -> str:
    """The model folder (or Hub id) the finished verifier stage recorded."""
    return read_manifest(profile, "verifier")["outputs"]["model"]


def stand_in_outputs(stage: str, **outputs: Any) -> Outputs:
    """``stage``'s outputs as its contract types them, unchecked: ``outputs`` over neutral
    values of every other required field (for a test that does not run the stage)."""
    model = CONTRACTS[stage].outputs

    def neutral_value(annotation: Any) -> Any:
        if get_origin(annotation) is Literal:
            return get_args(annotation)[0]
        by_type = {int: 0, str: "", bool: False, float: 0.0, list: [], dict: {}}
        return by_type.get(get_origin(annotation) or annotation)

    neutral = {
        name: neutral_value(field.annotation)
        for name, field in model.model_fields.items()
        if field.is_required()
    }
    return model.model_construct(**{**neutral, **outputs})


def stand_in_manifest(
    profile: Profile,
    stage: str,
    *,
    counts: dict[str, Any] | None = None,
    data_revision: dict[str, Any] | None = None,
    wall_time_s: float = 0.0,
    **outputs: Any,
) -> None:
    """A finished ``stage`` as its contract describes it, for a test that does not run it."""
    manifest = Manifest[CONTRACTS[stage].outputs](
        stage=stage, run=profile.run.name, started_at="", finished_at="",
        wall_time_s=wall_time_s, git={}, packages={}, hardware={}, inputs={},
        data_revision=data_revision or {}, counts=counts or {}, bytes=0,
        outputs=stand_in_outputs(stage, **outputs), config=profile.dump(),
    )  # fmt: skip
    path = profile.run.run_dir / stage / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest.model_dump_json())
