"""Stage `licenses`: prove that every row the drafter was trained on may be published.

Run as: python -m release.licenses --config configs/tiny.yaml   (make licenses)

Reads the `generate` stage (its responses and data revision) and the committed license manifest
(``release.licenses_file``, ``release/licenses.yaml``), judges them by the rules of
:mod:`release.license_rules`, and writes ``<run>/licenses/report.json``, ``report.md`` and
``manifest.json``.

Invariants:
- the sources checked are the ``source`` values actually present in the generated data, counted
  (rows kept, rows skipped, prompt and completion tokens), never a list typed by hand;
- the prompt set itself must be listed under ``datasets`` at exactly the revision generate read
  (a Hub commit, or ``sha256:<hex>`` of a local file), so edited data needs its license reviewed;
- a failed check still writes its report and manifest (``passed: false``), then exits 2; card
  and publish refuse to go on from a failed, missing or stale check
  (:func:`pipeline.core.manifest.passed_license_report`).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_bytes, atomic_write_json
from pipeline.core.config import Profile
from pipeline.core.contracts import LicensesOutputs
from pipeline.core.manifest import now, read_input, stage_dir, write_manifest
from pipeline.core.portable import REPO_ROOT
from pipeline.core.responses import read_responses
from release.license_rules import (
    BUILT_VERIFIER,
    LicenseCheckError,
    judge_release,
    load_license_manifest,
)


def count_sources(responses: Path) -> dict[str, dict[str, int]]:
    """Rows kept and skipped, and prompt/completion tokens, per `source` value in the data."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in read_responses(responses):
        c = counts[record.source]
        c["skipped_rows" if record.skip_reason else "rows"] += 1
        usage = record.usage or {}
        c["prompt_tokens"] += usage.get("prompt_tokens", 0)
        c["completion_tokens"] += usage.get("completion_tokens", 0)
    keys = ("rows", "skipped_rows", "prompt_tokens", "completion_tokens")
    return {s: {k: c[k] for k in keys} for s, c in sorted(counts.items())}


def verifier_key(profile: Profile) -> str:
    if profile.verifier.build is not None:
        return BUILT_VERIFIER
    if profile.verifier.package is not None:  # the weights' own name, whatever ships them
        return profile.verifier.package.model_name
    return str(profile.verifier.model)


def check_licenses(profile: Profile) -> dict[str, Any]:
    """The whole check as data: per-source verdicts and counts, failures, the drafter's license."""
    generate = read_input(profile, "licenses", "generate")
    responses = stage_dir(profile, "generate") / generate.outputs.responses
    path = profile.release.licenses_file
    report = judge_release(
        load_license_manifest(path if path.is_absolute() else REPO_ROOT / path),
        path,
        generate.data_revision,
        count_sources(responses),
        verifier_key(profile),
        profile.release.allowed_licenses,
        profile.release.allow_non_commercial,
        (generate.outputs.self_written or {}).get("sha256"),
    )
    if package := profile.verifier.package:  # the verifier stage checked these hashes
        report["verifier"]["package"] = package.model_dump()
    # How generate chose its prompts (data.max_samples, data.sample_seed), per source.
    return report | {"sampling": generate.outputs.sampling}


def report_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"License check: **{'passed' if report['passed'] else 'FAILED'}**",
        "",
        "| source | dataset | revision | license (SPDX) | rows | skipped | tokens | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["sources"]:
        tokens = s["prompt_tokens"] + s["completion_tokens"]
        lines.append(
            f"| {s['source']} | {s.get('dataset', '?')} | {str(s.get('revision'))[:19]} "
            f"| {s.get('spdx') or s.get('license') or 'none'} | {s['rows']} | {s['skipped_rows']} "
            f"| {tokens} | {'yes' if s['ok'] else 'no'} |"
        )
    lines += sampling_markdown(report.get("sampling"))
    if report["drafter_license"]:
        d = report["drafter_license"]
        lines += ["", f"Drafter license (derived from the verifier): `{d['spdx']}`"]
    if report["failures"]:
        lines += ["", "Failures:", *[f"- {f}" for f in report["failures"]]]
    return "\n".join(lines) + "\n"


def sampling_markdown(sampling: dict[str, Any] | None) -> list[str]:
    """How the prompts were drawn from each source: the lines that show a skewed sample."""
    if not sampling:
        return []
    by_source = sampling["by_source"]
    drawn = sum(c["sampled"] for c in by_source.values())
    available = sum(c["available"] for c in by_source.values())
    how = {
        "all": "every row",
        "stratified": f"a random sample stratified by source, seed {sampling['seed']}",
        "random": f"a random sample, seed {sampling['seed']}",
    }[sampling["method"]]
    lines = ["", f"Prompts: {drawn} of {available} rows, {how}.", ""]
    lines += ["| source | sampled | available | share |", "|---|---|---|---|"]
    for source, c in by_source.items():
        share = c["available"] / available if available else 0
        lines.append(f"| {source} | {c['sampled']} | {c['available']} | {share:.1%} |")
    return lines


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "licenses")
    folder.mkdir(parents=True, exist_ok=True)
    report = check_licenses(profile)
    atomic_write_json(folder / "report.json", report)
    atomic_write_bytes(folder / "report.md", report_markdown(report).encode())
    manifest = write_manifest(
        profile,
        "licenses",
        started_at=started,
        counts={
            "input": len(report["sources"]),
            "succeeded": sum(bool(s["ok"]) for s in report["sources"]),
            "skipped": 0,
            "failed": sum(not s["ok"] for s in report["sources"]),
            **report["totals"],
        },
        outputs=LicensesOutputs(
            passed=report["passed"],
            report="report.json",
            drafter_license=report["drafter_license"],
        ),
        data_revision=read_input(profile, "licenses", "generate").data_revision,
    )
    if not report["passed"]:
        raise LicenseCheckError(
            f"license check failed ({len(report['failures'])} problem(s)); the report is "
            f"{folder / 'report.md'}:\n  " + "\n  ".join(report["failures"])
        )
    return manifest


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("licenses", run, argv)


if __name__ == "__main__":
    main()
