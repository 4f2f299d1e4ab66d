"""Generation is exactly-once by prompt id across a SIGKILL of the real vLLM server.

The rerun is started before its new server, so it also shows that a server still loading is
waited for (up to ``server.startup_timeout_s``) rather than counted as failures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.build_verifier import resolved_verifier
from pipeline.config import load_profile
from pipeline.prompts import load_prompts
from pipeline.vllm_server import LOOPBACK, free_port, vllm_server

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
SAMPLES = 120


def ids_in(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def generate(overrides: list[str], base_url: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipeline.generate", "--config", "configs/tiny.yaml"]
    return subprocess.Popen(
        [*cmd, *overrides, f"server.base_url={base_url}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PROGRESS": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_generation_resumes_exactly_once_after_the_server_is_killed(tiny_run, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        f"data.max_samples={SAMPLES}",
        "generate.concurrency=4",
        "generate.max_retries=1",
        "server.startup_timeout_s=300",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    # The verifier built by the session's pipeline run, declared finished in this run folder.
    (profile.run.run_dir / "verifier").mkdir(parents=True)
    shutil.copy(
        tiny_run.run.run_dir / "verifier" / "manifest.json", profile.run.run_dir / "verifier"
    )
    model = resolved_verifier(profile)["model"]
    responses = profile.run.run_dir / "generate" / "responses.jsonl"

    with vllm_server(profile, model, tmp_path / "first.log", use_base_url=False) as server:
        proc = generate(overrides, server.base_url)
        deadline = time.monotonic() + 300
        while not (responses.exists() and len(ids_in(responses)) >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert "failed after retries" in stderr and "rerun `make generate`" in stderr
    assert not (profile.run.run_dir / "generate" / "manifest.json").exists()
    first = ids_in(responses)
    assert 20 <= len(first) < SAMPLES and len(set(first)) == len(first)

    # The rerun starts before its server does: it must wait for the loading server, not fail.
    port = free_port(LOOPBACK)
    proc = generate(overrides, f"http://{LOOPBACK}:{port}")
    time.sleep(5)
    assert proc.poll() is None, proc.communicate()
    restarted = load_profile(REPO / "configs" / "tiny.yaml", [*overrides, f"server.port={port}"])
    with vllm_server(restarted, model, tmp_path / "second.log", use_base_url=False):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert f"for vLLM at http://{LOOPBACK}:{port} to load" in stderr
    final = ids_in(responses)
    expected = {r.id for r in load_prompts("data/prompts/tiny-blend.jsonl", None, "train", SAMPLES)}
    assert len(final) == len(set(final)) == SAMPLES and set(final) == expected
    assert final[: len(first)] == first  # finished work was kept, not redone
    counts = json.loads((profile.run.run_dir / "generate" / "manifest.json").read_text())["counts"]
    assert counts["input"] == SAMPLES and counts["failed"] == 0
