"""External tools a stage runs (speculators' trainer and data tools) die with the stage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.core.errors import PipelineError
from pipeline.serving.logged_process import run_logged
from tests.helpers import alive_after

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent

# A "trainer" with a worker of its own; both write their pids, then sleep.
TOOL = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {worker.pid}")
time.sleep(600)
"""

# A stage that runs the tool through run_logged and is then SIGKILLed by the test.
STAGE = """
import sys
from pipeline.core.errors import PipelineError
from pipeline.serving.logged_process import run_logged
from pathlib import Path
tool, pids, log = sys.argv[1:]
run_logged([sys.executable, "-c", tool, pids], Path(log), PipelineError, "tool")
"""


def wait_for(path: Path, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def test_a_sigkilled_stage_takes_its_tool_and_the_tools_workers_with_it(tmp_path):
    pids = tmp_path / "pids"
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE, TOOL, str(pids), str(tmp_path / "tool.log")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    procs = [psutil.Process(int(pid)) for pid in wait_for(pids).split()]  # tool, worker
    os.kill(stage.pid, signal.SIGKILL)
    stage.wait()
    assert alive_after(procs, 10) == [], "outlived their SIGKILLed stage"


def test_a_failing_tool_is_one_error_with_its_status_and_log(tmp_path):
    log_path = tmp_path / "tool.log"
    with pytest.raises(PipelineError, match=r"^tool failed with status 3; log .*tool.log:\nno"):
        run_logged(
            [sys.executable, "-c", "import sys; print('no'); sys.exit(3)"], log_path,
            PipelineError, "tool",
        )  # fmt: skip
    run_logged([sys.executable, "-c", "print('yes')"], log_path, PipelineError, "tool")
    assert log_path.read_text().splitlines() == ["no", "yes"]


# A tool with a worker of its own that produces three files in argv[2], then hangs.
HUNG_TOOL = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {worker.pid}")
for i in range(3):
    open(os.path.join(sys.argv[2], str(i)), "w").close()
time.sleep(600)
"""


def test_a_tool_that_stops_making_progress_is_stopped_with_its_workers(tmp_path):
    """A hung tool (speculators' data generation once the volume filled) is not waited on for
    ever: once what it produces stands still for stall_s, it and its workers are stopped."""
    pids, produced = tmp_path / "pids", tmp_path / "produced"
    produced.mkdir()
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"^tool made no progress for 3 s and was stopped"):
        run_logged(
            [sys.executable, "-c", HUNG_TOOL, str(pids), str(produced)], tmp_path / "tool.log",
            PipelineError, "tool", progress=lambda: len(list(produced.iterdir())), stall_s=3,
        )  # fmt: skip
    assert time.monotonic() - started < 60
    assert len(list(produced.iterdir())) == 3
    ids = [int(pid) for pid in pids.read_text().split()]  # tool, worker
    assert alive_after([psutil.Process(pid) for pid in ids if psutil.pid_exists(pid)], 10) == []
