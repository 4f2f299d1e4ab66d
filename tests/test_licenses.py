"""The license check against the sources really present in generated data (no server needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest, stage_dir
from pipeline.core.prompts import data_revision, load_prompt_set
from release.licenses import LicenseCheckError, check_licenses, run
from tests.helpers import stand_in_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
SHIPPED = yaml.safe_load((REPO / "release" / "licenses.yaml").read_text())
PERFECTBLEND_SOURCES = [
    "meta-math/MetaMathQA",
    "openbmb/UltraInteract_sft",
    "mlabonne/ultrachat_200k_sft",
    "HuggingFaceH4/orca-math-word-problems-200k",
    "HuggingFaceH4/ultrafeedback_binarized",
    "theblackcat102/evol-codealpaca-v1",
    "Post-training-Data-Flywheel/AutoIF-instruct-61k",
    "mlabonne/lmsys-arena-human-preference-55k-sharegpt",
]


def generated(
    profile,
    sources: list[str],
    revision: dict | None = None,
    skipped: int = 0,
    sampling: dict | None = None,
) -> None:
    """A finished generate stage whose records carry ``sources`` (one record each)."""
    folder = stage_dir(profile, "generate")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "responses.jsonl").open("w") as fh:
        for i, source in enumerate(sources):
            record = {
                "id": f"r{i}",
                "source": source,
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 30},
                "skip_reason": "empty_response" if i < skipped else None,
            }
            fh.write(json.dumps(record) + "\n")
    stand_in_manifest(
        profile,
        "generate",
        counts={"input": len(sources)},
        data_revision=revision or data_revision(profile.data.dataset, profile.data.revision),
        responses="responses.jsonl",
        skipped="skipped.jsonl",
        sampling=sampling or {},
        replicas=[],
    )


def tiny(tmp_path, *overrides: str):
    return load_profile(REPO / "configs/tiny.yaml", [f"run.output_dir={tmp_path}", *overrides])


def with_sources(tmp_path, extra: dict) -> str:
    """A license manifest: the shipped one plus ``extra`` sources."""
    manifest = {**SHIPPED, "sources": {**SHIPPED["sources"], **extra}}
    path = tmp_path / "licenses.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return f"release.licenses_file={path}"


def source(license_id: str | None, **fields) -> dict:
    return {
        "dataset": "someone/some-set",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "license": license_id,
        "evidence": "its card",
        "provenance": "people",
        **fields,
    }


def test_the_shipped_prompt_set_passes_with_counts_per_source(tmp_path):
    profile = tiny(tmp_path)
    rows = [json.loads(line) for line in (REPO / "data/prompts/tiny-blend.jsonl").open()]
    generated(profile, [r["source"] for r in rows], skipped=3)
    manifest = run(profile)
    assert manifest["outputs"]["passed"]
    report = json.loads((stage_dir(profile, "licenses") / "report.json").read_text())
    assert len(report["sources"]) == 8
    assert sum(s["rows"] + s["skipped_rows"] for s in report["sources"]) == len(rows) == 320
    assert report["totals"]["skipped_rows"] == 3
    assert report["totals"]["completion_tokens"] == 30 * 320
    assert {s["spdx"] for s in report["sources"]} == {"CC0-1.0"}
    assert report["dataset"]["revision"].startswith("sha256:")
    assert manifest["outputs"]["drafter_license"]["spdx"] == "Apache-2.0"  # the verifier's
    assert "passed" in (stage_dir(profile, "licenses") / "report.md").read_text()


def test_the_report_shows_how_the_prompts_were_sampled_from_each_source(tmp_path):
    profile = tiny(tmp_path, "data.max_samples=16", "data.sample_seed=3")
    d = profile.data
    sample = load_prompt_set(d.dataset, None, "train", d.max_samples, seed=d.sample_seed)
    generated(profile, [r.source for r in sample.rows], sampling=sample.sampling.record())
    run(profile)
    report = json.loads((stage_dir(profile, "licenses") / "report.json").read_text())
    assert report["sampling"]["seed"] == 3 and report["sampling"]["method"] == "stratified"
    assert report["sampling"]["by_source"]["tiny-blend/math"] == {"available": 40, "sampled": 2}
    text = (stage_dir(profile, "licenses") / "report.md").read_text()
    assert "Prompts: 16 of 320 rows, a random sample stratified by source, seed 3." in text
    assert "| tiny-blend/math | 2 | 40 | 12.5% |" in text


def test_a_source_missing_from_the_manifest_fails_and_keeps_its_report(tmp_path):
    profile = tiny(tmp_path)
    generated(profile, ["tiny-blend/math", "mystery/set", "mystery/set"])
    with pytest.raises(LicenseCheckError, match=r"source 'mystery/set' \(2 rows\): missing from"):
        run(profile)
    assert read_manifest(profile, "licenses")["outputs"]["passed"] is False
    assert "FAILED" in (stage_dir(profile, "licenses") / "report.md").read_text()


CHECK_COMMAND = (sys.executable, "-m", "release.licenses", "--config", "configs/tiny.yaml")


def test_the_command_exits_2_naming_the_source(tmp_path):
    profile = tiny(tmp_path)
    generated(profile, ["tiny-blend/math", "mystery/set"])
    proc = subprocess.run(
        [*CHECK_COMMAND, f"run.output_dir={tmp_path}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "mystery/set" in proc.stderr and "add its dataset, revision, license" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_non_commercial_data_fails_unless_allowed_and_then_taints_the_drafter(tmp_path):
    extra = with_sources(tmp_path, {"nc/set": source("cc-by-nc-4.0")})
    profile = tiny(tmp_path, extra)
    generated(profile, ["tiny-blend/math", "nc/set"])
    report = check_licenses(profile)
    assert not report["passed"]
    assert any("non-commercial" in f and "allow_non_commercial" in f for f in report["failures"])

    allowed = check_licenses(tiny(tmp_path, extra, "release.allow_non_commercial=true"))
    assert allowed["passed"], allowed["failures"]
    drafter = allowed["drafter_license"]
    assert drafter["non_commercial"] and drafter["license"] == "other"
    assert drafter["spdx"] == "Apache-2.0 AND CC-BY-NC-4.0"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (source(None), "declares no license"),
        (source("other"), "is not an SPDX id; map it explicitly"),
        (source("llama3"), "is not an SPDX id"),
        (source("gpl-3.0"), "GPL-3.0-only is not in release.allowed_licenses"),
        (source("other", spdx="MIT AND GPL-3.0-only"), "GPL-3.0-only is not in"),
        (source("mit", spdx="Apache-2.0"), "license 'mit' is MIT, but spdx says Apache-2.0"),
        (source("cc-by-nd-4.0"), "forbids derivative works"),
    ],
)
def test_a_source_without_an_allowed_license_fails_with_the_reason(tmp_path, entry, message):
    profile = tiny(tmp_path, with_sources(tmp_path, {"odd/set": entry}))
    generated(profile, ["odd/set"])
    report = check_licenses(profile)
    assert not report["passed"]
    assert any("'odd/set'" in f and message in f for f in report["failures"]), report["failures"]


@pytest.mark.parametrize(
    "entry",
    [
        source("other", spdx="MIT OR GPL-3.0-only"),  # an OR passes through an allowed branch
        source("odc-by", spdx="ODC-By-1.0"),  # a Hub id SPDX lacks, mapped explicitly
        source("mit", declared_by="someone/original"),  # a mirror's license, from its original
    ],
)
def test_expressions_and_explicit_mappings_pass(tmp_path, entry):
    profile = tiny(tmp_path, with_sources(tmp_path, {"ok/set": entry}))
    generated(profile, ["ok/set"])
    report = check_licenses(profile)
    assert report["passed"], report["failures"]


def test_edited_data_needs_its_license_reviewed(tmp_path):
    profile = tiny(tmp_path)
    revision = {"dataset": "data/prompts/tiny-blend.jsonl", "revision": None, "sha256": "ab" * 32}
    generated(profile, ["tiny-blend/math"], revision=revision)
    report = check_licenses(profile)
    assert any("review that revision's license" in f for f in report["failures"])


def test_a_malformed_license_manifest_names_the_field(tmp_path):
    bad = tmp_path / "licenses.yaml"
    broken = {**SHIPPED, "sources": {"x": {**source("mit"), "licence": "mit"}}}
    bad.write_text(yaml.safe_dump(broken))
    profile = tiny(tmp_path, f"release.licenses_file={bad}")
    generated(profile, ["x"])
    with pytest.raises(LicenseCheckError, match=r"sources\.x\.licence: Extra inputs"):
        check_licenses(profile)


def test_the_hero_verifier_and_all_open_perfectblend_sources_are_vouched_for(tmp_path):
    profile = load_profile(REPO / "configs/kimi-k2.5.yaml", [f"run.output_dir={tmp_path}"])
    revision = {"dataset": profile.data.dataset, "revision": profile.data.revision}
    generated(profile, PERFECTBLEND_SOURCES, revision=revision)
    report = check_licenses(profile)
    assert report["passed"], report["failures"]
    assert {s["spdx"] for s in report["sources"]} <= {"MIT", "Apache-2.0"}
    drafter = report["drafter_license"]
    assert (drafter["license"], drafter["license_name"]) == ("other", "modified-mit")
    assert not drafter["non_commercial"]


def test_an_unpinned_hub_dataset_fails(tmp_path):
    profile = load_profile(REPO / "configs/kimi-k2.5.yaml", [f"run.output_dir={tmp_path}"])
    generated(profile, PERFECTBLEND_SOURCES[:1], revision={"dataset": profile.data.dataset})
    report = check_licenses(profile)
    assert any("not pinned" in f for f in report["failures"])


def test_prompts_the_verifier_wrote_are_licensed_as_the_verifier(tmp_path):
    profile = tiny(tmp_path)
    generated(profile, ["tiny-blend/math", "self-written", "self-written"])
    report = check_licenses(profile)
    assert report["passed"], report["failures"]
    (own,) = [s for s in report["sources"] if s["source"] == "self-written"]
    assert own["rows"] == 2 and own["written_by"] == "built-tiny-verifier"
    assert own["spdx"] == "Apache-2.0" and "Magpie" in own["provenance"]

    smol = load_profile(REPO / "configs/smollm2-135m.yaml", [f"run.output_dir={tmp_path}/s"])
    generated(smol, ["self-written"], revision=data_revision("data/prompts/tiny-blend.jsonl", None))
    report = check_licenses(smol)
    assert report["passed"], report["failures"]
    assert report["sources"][0]["written_by"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert report["verifier"]["package"]["gguf_sha256"] == smol.verifier.package.gguf_sha256


def test_prompts_written_by_an_unlisted_verifier_fail_by_name(tmp_path):
    manifest = {**SHIPPED, "verifiers": {}}
    path = tmp_path / "licenses.yaml"
    path.write_text(yaml.safe_dump(manifest))
    profile = tiny(tmp_path, f"release.licenses_file={path}")
    generated(profile, ["self-written"])
    report = check_licenses(profile)
    assert any(
        "'self-written'" in f and "built-tiny-verifier, which is not listed" in f
        for f in report["failures"]
    ), report["failures"]
