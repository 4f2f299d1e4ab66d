"""A vLLM server started by a stage dies with the stage: SIGKILL or Ctrl-C of the real generate
stage mid-run leaves no process of the server's group, and a rerun resumes the work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.core.config import load_profile
from pipeline.core.prompts import load_prompts
from pipeline.serving.server_guard import group_members
from pipeline.serving.vllm_server import SERVERS
from tests.helpers import REPO, TEST_OVERRIDES, alive_after, run_stage, seed_run_dir

pytestmark = pytest.mark.e2e
SAMPLES = 80


def ids_in(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def start_generate(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.generate", "--config", "configs/tiny.yaml", *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PROGRESS": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's SIGINT as a terminal's foreground stage gets it: a shell's background job
        # (a CI runner's, say) would have inherited it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def seeded_run(tiny_verifier, tmp_path: Path) -> tuple[list[str], Path]:
    """Overrides of a run folder whose verifier is the session's; its responses file."""
    overrides = [
        f"run.output_dir={tmp_path}",
        *TEST_OVERRIDES,
        f"data.max_samples={SAMPLES}",
        "generate.concurrency=4",
        "server.startup_timeout_s=300",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    return overrides, profile.run.run_dir


def server_mid_run(proc: subprocess.Popen, run_dir: Path) -> list[psutil.Process]:
    """Once some responses are written: the processes of the stage's server (its group and the
    guard's descendants)."""
    responses = run_dir / "generate" / "responses.jsonl"
    deadline = time.monotonic() + 300
    while len(ids_in(responses)) < 8:
        assert time.monotonic() < deadline, "no responses after 300s"
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        time.sleep(0.2)
    (record,) = (run_dir / SERVERS).glob("*.json")
    pgid = json.loads(record.read_text())["pgid"]
    guard = psutil.Process(pgid)
    procs = {p.pid: p for p in [*group_members(pgid), *guard.children(recursive=True)]}
    assert len(procs) >= 3, procs  # the guard, vLLM's API server and its engine core
    return list(procs.values())


def test_sigkill_of_the_stage_takes_its_server_down_and_the_rerun_resumes(tiny_verifier, tmp_path):
    overrides, run_dir = seeded_run(tiny_verifier, tmp_path)
    proc = start_generate(overrides)
    server = server_mid_run(proc, run_dir)
    proc.kill()
    proc.wait(timeout=30)
    assert alive_after(server, 10) == []
    first = ids_in(run_dir / "generate" / "responses.jsonl")
    assert 8 <= len(first) < SAMPLES

    rerun = run_stage("pipeline.generate", *overrides)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    final = ids_in(run_dir / "generate" / "responses.jsonl")
    expected = {r.id for r in load_prompts("data/prompts/tiny-blend.jsonl", None, "train", SAMPLES)}
    assert len(final) == len(set(final)) == SAMPLES and set(final) == expected
    assert final[: len(first)] == first  # finished work was kept, not redone
    assert list((run_dir / SERVERS).glob("*.json")) == []  # the dead stage's record is gone


def test_ctrl_c_of_the_stage_stops_its_server_and_says_so_in_one_line(tiny_verifier, tmp_path):
    overrides, run_dir = seeded_run(tiny_verifier, tmp_path)
    proc = start_generate(overrides)
    server = server_mid_run(proc, run_dir)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground stage
    _, stderr = proc.communicate(timeout=120)
    assert alive_after(server, 0) == []  # stopped before the stage exited
    assert proc.returncode != 0
    assert stderr.splitlines()[-1].startswith("error: "), stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    assert list((run_dir / SERVERS).glob("*.json")) == []
