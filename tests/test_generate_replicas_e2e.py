"""Generation spread over two real vLLM replicas on 127.0.0.1 (generate.replica_urls).

Kept in the slow tier: it starts two servers on a 2-core machine. The fan-out logic itself is
covered in the default run by tests/test_generate_replicas.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest
from pipeline.serving.vllm_server import vllm_server
from tests.helpers import run_stage, seed_run_dir, verifier_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).parent.parent
SAMPLES = 32


def test_two_replicas_share_the_prompts_and_each_is_done_once(tiny_verifier, tmp_path):
    base = [f"run.output_dir={tmp_path}", f"data.max_samples={SAMPLES}", "generate.concurrency=4"]
    profile = load_profile(REPO / "configs/tiny.yaml", base)
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    model = verifier_model(profile)
    with (
        vllm_server(profile, model, tmp_path / "a.log", use_base_url=False) as a,
        vllm_server(profile, model, tmp_path / "b.log", use_base_url=False) as b,
    ):
        urls = json.dumps([a.base_url, b.base_url])
        proc = run_stage("pipeline.generate", *base, f"generate.replica_urls={urls}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = read_manifest(profile, "generate")
    replicas = manifest["outputs"]["replicas"]
    assert [r["base_url"] for r in replicas] == [a.base_url, b.base_url]
    assert all(r["finished"] > 0 and r["failed"] == 0 for r in replicas)
    assert sum(r["finished"] for r in replicas) == SAMPLES == manifest["counts"]["input"]
    lines = (profile.run.run_dir / "generate/responses.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == SAMPLES
