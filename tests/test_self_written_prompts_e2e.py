"""Prompts the verifier writes itself (data.self_written, the Magpie method), for real.

The tiny run's verifier is served by vLLM on 127.0.0.1; generate first asks it for prompts
from its chat template's user-turn prefix, keeps the distinct ones, then regenerates their
replies beside the shipped set's. The license check licenses them as the verifier, and a rerun
reads the prompt file instead of asking again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest, stage_dir
from pipeline.core.prompts import load_prompt_set
from pipeline.serving.self_written_prompts import normalised, user_turn_frame
from tests.helpers import TEST_OVERRIDES, run_stage, seed_run_dir

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent


def test_the_verifier_writes_prompts_that_are_answered_licensed_and_reused(tiny_verifier, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        *TEST_OVERRIDES,
        "data.max_samples=8",
        "data.self_written.count=8",
        "data.self_written.max_tokens=96",
        "generate.max_tokens=96",
    ]
    profile = load_profile(REPO / "configs/tiny.yaml", overrides)
    seed_run_dir(tiny_verifier, profile, ("verifier",))
    first = run_stage("pipeline.generate", *overrides)
    assert first.returncode == 0, first.stderr[-3000:]

    folder = stage_dir(profile, "generate")
    written = read_manifest(profile, "generate")["outputs"]["self_written"]
    own = load_prompt_set(str(folder / "self-written-prompts.jsonl"), None, "train", None)
    assert written["kept"] == len(own.rows) == 8
    assert written["requested"] >= 8 and written["requested"] <= 24
    texts = [row.messages[0]["content"] for row in own.rows]
    assert len({normalised(t) for t in texts}) == 8 and min(map(len, texts)) >= 16
    frame = user_turn_frame(str(profile.run.run_dir / "verifier" / "model"), None, True)
    assert frame.stop_token_ids  # Kimi's <|im_end|>: a special token ends the user turn

    records = [json.loads(line) for line in (folder / "responses.jsonl").open()]
    by_source = {r["source"] for r in records}
    assert "self-written" in by_source and len(by_source) > 1
    assert sum(r["source"] == "self-written" for r in records) == 8
    counts = read_manifest(profile, "generate")["counts"]
    assert counts["input"] == 16 and counts["failed"] == 0
    sampling = read_manifest(profile, "generate")["outputs"]["sampling"]["by_source"]
    assert sampling["self-written"] == {"available": 8, "sampled": 8}

    licenses = run_stage("release.licenses", *overrides)
    assert licenses.returncode == 0, licenses.stderr[-3000:]
    report = json.loads((stage_dir(profile, "licenses") / "report.json").read_text())
    (mine,) = [s for s in report["sources"] if s["source"] == "self-written"]
    assert mine["written_by"] == "built-tiny-verifier" and mine["ok"]
    assert mine["revision"] == f"sha256:{written['sha256']}"

    before = (folder / "self-written-prompts.jsonl").read_bytes()
    log_size = (folder / "vllm.log").stat().st_size
    again = run_stage("pipeline.generate", *overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (folder / "self-written-prompts.jsonl").read_bytes() == before
    assert (folder / "vllm.log").stat().st_size == log_size  # no server: nothing left to ask
    assert "16 prompts, 16 already finished, 0 to do" in again.stderr
