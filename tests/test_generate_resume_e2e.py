"""Generation is exactly-once by prompt id across a SIGKILL of the real vLLM server.

The rerun is started before its new server, so it also shows that a server still loading is
waited for (up to ``server.startup_timeout_s``) rather than counted as failures: the new server is
started once the rerun says it is waiting, on a port outside the kernel's ephemeral range, which
no other process is handed meanwhile (as it could be a port that ``free_port`` gave back).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.prompts import load_prompts
from pipeline.serving.vllm_api import LOOPBACK
from pipeline.serving.vllm_server import vllm_server
from tests.helpers import seed_run_dir, verifier_model

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
SAMPLES = 60


def ids_in(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def unassigned_port() -> int:
    """A free port below the ephemeral range: the kernel hands it to no socket by itself."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10000, low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in 10000-{low}")


def wait_for_line(proc: subprocess.Popen, text: str) -> list[str]:
    """``proc``'s stderr lines up to the first that contains ``text``."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"exited ({proc.wait()}) before saying {text!r}:\n{''.join(lines)}")


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


def test_generation_resumes_exactly_once_after_the_server_is_killed(tiny_verifier, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        f"data.max_samples={SAMPLES}",
        "generate.concurrency=4",
        "generate.max_retries=1",
        "server.startup_timeout_s=300",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    # The verifier built by the session's pipeline run, declared finished in this run folder.
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    model = verifier_model(profile)
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
    port = unassigned_port()
    proc = generate(overrides, f"http://{LOOPBACK}:{port}")
    waited = wait_for_line(proc, f"for vLLM at http://{LOOPBACK}:{port} to load")
    restarted = load_profile(REPO / "configs" / "tiny.yaml", [*overrides, f"server.port={port}"])
    with vllm_server(restarted, model, tmp_path / "second.log", use_base_url=False):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, "".join(waited) + stderr
    final = ids_in(responses)
    expected = {r.id for r in load_prompts("data/prompts/tiny-blend.jsonl", None, "train", SAMPLES)}
    assert len(final) == len(set(final)) == SAMPLES and set(final) == expected
    assert final[: len(first)] == first  # finished work was kept, not redone
    counts = json.loads((profile.run.run_dir / "generate" / "manifest.json").read_text())["counts"]
    assert counts["input"] == SAMPLES and counts["failed"] == 0
