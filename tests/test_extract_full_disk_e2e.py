"""A disk that fills up mid-extraction: no partial shard, a message saying what to free, resume.

The run folder lives on a real 160 MB filesystem. Once extraction has written some shards, a
ballast file takes nearly all the free space, as another job on a shared volume would. The stage
must stop with exit status 2, naming the space to free; every shard on disk must be whole; after
the ballast is deleted, a rerun completes with exactly the expected bytes and keeps the shards
it already had.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.core.config import load_profile
from tests.helpers import fill_volume, seed_run_dir, small_volume

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
VOLUME_BYTES = 160 * 2**20


def extract(overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipeline.extract", "--config", "configs/tiny.yaml", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROGRESS": "0"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(proc: subprocess.Popen, timeout: float, folder: Path) -> str:
    """The stage's stderr once it exits; past ``timeout`` it is killed (its servers die with
    it) and the test fails with the tails of its logs, so that a hang says where it hung."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        tails = [
            f"--- {log.name}:\n" + "".join(log.read_text(errors="replace").splitlines(True)[-25:])
            for log in sorted(folder.glob("*.log"))
        ]
        pytest.fail(
            f"extract still running after {timeout} s\n{stderr[-3000:]}\n" + "\n".join(tails)
        )


def shard_inodes(hs_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in hs_dir.glob("hs_*.safetensors")}


def test_full_disk_stops_cleanly_and_a_rerun_resumes(tiny_generated, tmp_path):
    with small_volume(tmp_path / "volume", VOLUME_BYTES) as volume:
        overrides = [
            f"run.output_dir={volume}",
            "extract.disk_reserve_gib=0.01",
            # Bounded: a request that waits on a shard that will never come gives up in time.
            "generate.request_timeout_s=30",
            "generate.max_retries=1",
        ]
        profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
        seed_run_dir(tiny_generated, profile, ("verifier", "generate"))
        hs_dir = profile.run.run_dir / "extract" / "prepared" / "hidden_states"

        proc = extract(overrides)
        deadline = time.monotonic() + 400
        while len(shard_inodes(hs_dir)) < 40 if hs_dir.exists() else True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        ballast = fill_volume(volume, leave_bytes=2 * 2**20)
        stderr = finished(proc, 300, profile.run.run_dir / "extract")
        assert proc.returncode == 2, stderr
        assert "not enough disk for hidden states" in stderr, stderr
        assert "shards are written and kept" in stderr and "free at least" in stderr
        assert not (profile.run.run_dir / "extract" / "manifest.json").exists()

        before = shard_inodes(hs_dir)
        kept = json.loads((profile.run.run_dir / "generate" / "manifest.json").read_text())
        assert 40 <= len(before) < kept["counts"]["succeeded"]  # one row per kept conversation
        assert not list(volume.rglob("*.tmp")), "a temporary shard was left behind"
        for name in before:  # every shard under a real name is whole
            with safe_open(hs_dir / name, framework="pt") as f:
                assert f.get_slice("hidden_states").get_shape()[0] == len(f.get_tensor("token_ids"))

        ballast.unlink()
        proc = extract(overrides)
        stderr = finished(proc, 600, profile.run.run_dir / "extract")
        assert proc.returncode == 0, stderr
        manifest = json.loads((profile.run.run_dir / "extract" / "manifest.json").read_text())
        out = manifest["outputs"]
        assert out["hidden_state_bytes"] == out["expected_hidden_state_bytes"]
        assert out["files"] == out["rows"] == manifest["counts"]["succeeded"]
        after = shard_inodes(hs_dir)
        assert all(after[name] == inode for name, inode in before.items())  # kept, not redone
