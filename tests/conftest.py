import os
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from tests.helpers import TEST_OVERRIDES, skip_unless_ci
from tests.listener_guard import run_watched

REPO = Path(__file__).parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def docker_engine():
    """The private Docker engine tests/docker_engine.py started for this run (its client)."""
    import docker

    if why := os.environ.get("EAGLE3_NO_ENGINE"):
        skip_unless_ci(f"no Docker engine on this machine: {why}")
    if not os.environ.get("EAGLE3_ENGINE_DIR"):
        skip_unless_ci(
            "no private Docker engine: run the container tests through `make test` or "
            "`make test-containers`, which start one"
        )
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_run_watched(tmp_path_factory):
    """`make hero-run` on the tiny profile, once per session, its every listener watched
    (tests/listener_guard.py); yields its profile and the guard (None for a reused run).

    Its time is the fixture's own (``timeout_func_only``: pytest's per-test timeout counts test
    bodies only), bounded here, so no test is charged for it. ``TINY_RUN_DIR`` reuses a finished
    run of the same overrides across sessions while developing; CI never sets it.
    """
    reuse = os.environ.get("TINY_RUN_DIR")
    out = Path(reuse) if reuse else tmp_path_factory.mktemp("runs")
    overrides = [f"run.output_dir={out}", *TEST_OVERRIDES]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    if reuse and (out / "tiny" / "publish" / "manifest.json").exists():
        return profile, None
    proc, guard = run_watched(
        ["make", "hero-run", "CONFIG=configs/tiny.yaml", f"ARGS={' '.join(overrides)}"],
        timeout=1500,
        cwd=REPO,
        env={**os.environ, "PROGRESS": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return profile, guard


@pytest.fixture(scope="session")
def tiny_run(tiny_run_watched):
    """The tiny profile's finished `make hero-run` (see ``tiny_run_watched``): its profile."""
    return tiny_run_watched[0]
