import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.contracts import STAGES
from tests.helpers import TEST_OVERRIDES, skip_unless_ci
from tests.listener_guard import kill_tree, run_watched

REPO = Path(__file__).parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


# The fixture that waits for each stage of the shared tiny run (STAGES: pipeline order): a test
# asks for the earliest stage it reads, so it can run while the rest of the run is still going.
TINY_STAGES = {
    "tiny_verifier": "verifier",
    "tiny_generated": "generate",
    "tiny_extracted": "extract",
    "tiny_trained": "train",
    "tiny_run": "publish",
    "tiny_run_watched": "publish",
}
TINY_RUN_TIMEOUT_S = 2400  # 19-20 min alone on 2 cores; tests run beside it


class BackgroundTinyRun:
    """`make hero-run` on the tiny profile on a thread of this session, every listener of its
    process tree watched (tests/listener_guard.py). It starts as soon as the session's tests are
    collected, and the tests that do not read it run first; a stage's fixture waits for that
    stage's manifest (written last, atomically), so a test seeded with the verifier runs while
    the drafter trains. It is stopped, its tree killed, when the session ends."""

    def __init__(self, profile, overrides: list[str]):
        self.profile = profile
        self.overrides = overrides
        self.proc = None
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tiny-run", daemon=True)

    def _run(self) -> None:
        args = " ".join(self.overrides)
        try:
            self.result = run_watched(
                ["make", "hero-run", "CONFIG=configs/tiny.yaml", f"ARGS={args}"],
                timeout=TINY_RUN_TIMEOUT_S,
                started=lambda proc: setattr(self, "proc", proc),
                cwd=REPO,
                env={**os.environ, "PROGRESS": "0"},
            )
        except BaseException as err:  # noted for every fixture that waits on the run
            self.error = err

    def failure(self) -> str | None:
        if self.error is not None:
            return f"the shared tiny run failed: {self.error}"
        if self.result is not None and self.result[0].returncode != 0:
            proc = self.result[0]
            return f"the shared tiny run failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        return None

    def wait_for(self, stage: str):
        """The profile once ``stage`` is finished; fails with the run's output if it is not."""
        manifest = self.profile.run.run_dir / stage / "manifest.json"
        while not manifest.exists() and self.thread.is_alive():
            time.sleep(1)
        if why := self.failure():
            pytest.fail(why, pytrace=False)
        assert manifest.exists(), f"the shared tiny run ended without {manifest}"
        return self.profile

    def join(self, timeout: float | None = None) -> None:
        """Until the run has ended (at once for a reused run, which never starts)."""
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.join(timeout=120)


def tiny_run_need(item) -> int:
    """How far into the tiny run ``item`` reads: -1 for not at all."""
    stages = [TINY_STAGES[name] for name in item.fixturenames if name in TINY_STAGES]
    return max((STAGES.index(stage) for stage in stages), default=-1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a CUDA device. Whole modules run in order of the earliest
    tiny-run stage they read (none first), each module's tests in their own order (its
    module-scoped fixtures set up once)."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
    first_need: dict[str, int] = {}
    for item in items:
        need = tiny_run_need(item)
        if need >= 0:
            module = item.nodeid.split("::")[0]
            first_need[module] = min(first_need.get(module, need), need)
    items.sort(key=lambda item: first_need.get(item.nodeid.split("::")[0], -1))


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    if not any(tiny_run_need(item) >= 0 for item in session.items):
        return
    reuse = os.environ.get("TINY_RUN_DIR")
    # The session's tmp_path_factory (the fixture's own object, set up before collection).
    out = Path(reuse) if reuse else session.config._tmp_path_factory.mktemp("runs")
    overrides = [f"run.output_dir={out}", *TEST_OVERRIDES]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    run = BackgroundTinyRun(profile, overrides)
    session.config.stash[TINY_RUN] = run
    if reuse and (out / "tiny" / "publish" / "manifest.json").exists():
        return  # a finished run of the same overrides, reused while developing; CI never sets it
    run.thread.start()


def pytest_sessionfinish(session):
    if (run := session.config.stash.get(TINY_RUN, None)) is not None:
        run.stop()


TINY_RUN = pytest.StashKey[BackgroundTinyRun]()


def _stage_fixture(stage: str):
    @pytest.fixture(scope="session")
    def wait(request):
        return request.config.stash[TINY_RUN].wait_for(stage)

    wait.__doc__ = f"The shared tiny run's profile once its {stage} stage has finished."
    return wait


tiny_verifier = _stage_fixture("verifier")
tiny_generated = _stage_fixture("generate")
tiny_extracted = _stage_fixture("extract")
tiny_trained = _stage_fixture("train")


@pytest.fixture(scope="session")
def tiny_run_watched(request):
    """The shared tiny run (``BackgroundTinyRun``) to its end: its profile and its listener
    guard (None for a reused run). Its time is the fixtures' own (``timeout_func_only``:
    pytest's per-test timeout counts test bodies only), bounded by ``TINY_RUN_TIMEOUT_S``."""
    run = request.config.stash[TINY_RUN]
    run.join()  # publish's manifest is written before make exits and the guard is handed back
    return run.wait_for("publish"), run.result[1] if run.result else None


@pytest.fixture(scope="session")
def tiny_run(tiny_run_watched):
    """The tiny profile's finished `make hero-run` (see ``tiny_run_watched``): its profile."""
    return tiny_run_watched[0]
