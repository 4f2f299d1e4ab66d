"""The license rules, as pure functions of data: which licenses a release may carry.

The stage (:mod:`release.licenses`) reads the inputs; this module only judges them:

- every license is a Hub id as its card declares it, normalised to SPDX by license-expression;
  ids it does not know (``other``, ``llama3``, ``odc-by``) need an explicit ``spdx:`` mapping;
- an SPDX expression passes when some choice of its OR branches has every AND term in
  ``release.allowed_licenses``; non-commercial terms (``-NC-``, or ``non_commercial: true``) fail
  unless ``release.allow_non_commercial``, and then make the drafter's license non-commercial;
- the drafter's license is derived, never typed: the verifier's (a drafter trained on its hidden
  states and outputs is conservatively a derivative), plus any non-commercial data terms;
- prompts the verifier wrote itself (source ``self-written``) are licensed as the verifier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from license_expression import AND, OR, ExpressionError, LicenseSymbol, get_spdx_licensing
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.core.errors import PipelineError
from pipeline.core.prompts import SELF_WRITTEN_SOURCE

BUILT_VERIFIER = "built-tiny-verifier"  # the key of the verifier the project builds itself
LICENSING = get_spdx_licensing()
NON_COMMERCIAL = re.compile(r"-NC(-|$)")  # CC-BY-NC-4.0, CC-BY-NC-SA-4.0, ...
NO_DERIVATIVES = re.compile(r"-ND(-|$)")


class LicenseCheckError(PipelineError):
    """The license manifest is malformed, or the data may not be published under it."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # As the card declares it: a Hub license id (mit, apache-2.0, other, ...); None: no license.
    license: str | None = None
    license_name: str | None = None  # Hub cards with license: other name and link theirs
    license_link: str | None = None
    spdx: str | None = None  # the SPDX expression (or LicenseRef-*) for ids SPDX lacks
    non_commercial: bool = False  # for a LicenseRef whose terms forbid commercial use
    # The dataset whose card declares `license` when this one's card has none (a mirror).
    declared_by: str | None = None
    evidence: str


class VerifierLicense(_Entry):
    # The license text shipped beside the drafter: a path in the verifier's files (a Hub id or
    # folder), or in this repository for the verifier the project builds.
    license_file: str


class DatasetLicense(_Entry):
    # The revision whose card was read: a Hub commit, or sha256:<hex> of a local file.
    revision: str = Field(pattern=r"^([0-9a-f]{7,40}|sha256:[0-9a-f]{64})$")
    provenance: str  # who wrote the prompts (people, or which models)


class SourceLicense(DatasetLicense):
    dataset: str  # the upstream dataset the rows with this source value come from


class LicenseManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    verifiers: dict[str, VerifierLicense]
    datasets: dict[str, DatasetLicense]
    sources: dict[str, SourceLicense]


def load_license_manifest(path: Path) -> LicenseManifest:
    if not path.is_file():
        raise LicenseCheckError(f"license manifest {path} does not exist (release.licenses_file)")
    try:
        return LicenseManifest.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValidationError as err:
        lines = [f"{path}: invalid license manifest ({err.error_count()} error(s))"]
        lines += [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise LicenseCheckError("\n".join(lines)) from None


@dataclass
class Verdict:
    """One license judged: its SPDX form, whether it passes, and whether it is non-commercial."""

    spdx: str | None
    ok: bool
    non_commercial: bool = False
    reasons: list[str] = field(default_factory=list)


def spdx_of(entry: _Entry) -> tuple[str | None, str | None]:
    """(SPDX expression, None) for an entry, or (None, why it has none)."""
    if not entry.license:
        return None, "declares no license"
    try:
        declared = LICENSING.parse(entry.license)
    except ExpressionError as err:
        return None, f"license {entry.license!r} does not parse: {err}"
    if entry.spdx is None:
        if LICENSING.unknown_license_keys(declared):
            return None, (
                f"license {entry.license!r} is not an SPDX id; map it explicitly with "
                "`spdx:` (an SPDX expression, or LicenseRef-<name> with license_name/link)"
            )
        return declared.render(), None
    try:
        mapped = LICENSING.parse(entry.spdx)
    except ExpressionError as err:
        return None, f"spdx {entry.spdx!r} does not parse: {err}"
    if not LICENSING.unknown_license_keys(declared) and declared != mapped:
        return None, f"license {entry.license!r} is {declared.render()}, but spdx says {entry.spdx}"
    return mapped.render(), None


def judge(entry: _Entry, allowed: set[str], allow_non_commercial: bool) -> Verdict:
    """Whether an entry's license lets a drafter trained on its data be published."""
    spdx, why_not = spdx_of(entry)
    if spdx is None:
        return Verdict(None, False, reasons=[why_not or "no license"])
    return _judge_expression(LICENSING.parse(spdx), entry, allowed, allow_non_commercial, spdx)


def _judge_expression(expr, entry, allowed, allow_nc, spdx) -> Verdict:
    if isinstance(expr, LicenseSymbol):
        key = expr.key
        non_commercial = bool(NON_COMMERCIAL.search(key)) or entry.non_commercial
        if NO_DERIVATIVES.search(key):
            return Verdict(spdx, False, reasons=[f"{key} forbids derivative works"])
        if non_commercial:
            if allow_nc:
                return Verdict(spdx, True, non_commercial=True)
            return Verdict(
                spdx,
                False,
                non_commercial=True,
                reasons=[
                    f"{key} is non-commercial: drop this source, or set "
                    "release.allow_non_commercial=true to publish a non-commercial drafter"
                ],
            )
        if key not in allowed:
            return Verdict(
                spdx,
                False,
                reasons=[
                    f"{key} is not in release.allowed_licenses ({', '.join(sorted(allowed))})"
                ],
            )
        return Verdict(spdx, True)
    parts = [_judge_expression(arg, entry, allowed, allow_nc, spdx) for arg in expr.args]
    if isinstance(expr, AND):
        return Verdict(
            spdx,
            all(p.ok for p in parts),
            non_commercial=any(p.non_commercial for p in parts),
            reasons=[r for p in parts for r in p.reasons],
        )
    if isinstance(expr, OR):  # the licensee picks a branch: the best one that passes
        passing = sorted((p for p in parts if p.ok), key=lambda p: p.non_commercial)
        if passing:
            return Verdict(spdx, True, non_commercial=passing[0].non_commercial)
        return Verdict(spdx, False, reasons=[r for p in parts for r in p.reasons])
    raise LicenseCheckError(f"unsupported license expression {spdx!r}")


def pinned_revision(data_revision: dict[str, Any]) -> str | None:
    if data_revision.get("sha256"):
        return f"sha256:{data_revision['sha256']}"
    return data_revision.get("revision")


def derive_drafter_license(
    verifier: VerifierLicense, verifier_spdx: str, non_commercial_sources: dict[str, str]
) -> dict[str, Any]:
    """The verifier's license, joined by the terms of any non-commercial data it was fed."""
    if not non_commercial_sources:
        return {
            "license": verifier.license,
            "license_name": verifier.license_name,
            "license_link": verifier.license_link,
            "spdx": verifier_spdx,
            "non_commercial": verifier.non_commercial,
        }
    terms = sorted(set(non_commercial_sources.values()))
    spdx = LICENSING.parse(" AND ".join([f"({verifier_spdx})", *[f"({t})" for t in terms]]))
    base = verifier.license_name or verifier.license
    return {
        "license": "other",
        "license_name": f"{base}-with-non-commercial-data",
        "license_link": "LICENSE",
        "spdx": spdx.render(),
        "non_commercial": True,
    }


def judge_release(
    manifest: LicenseManifest,
    path: Path,
    data_rev: dict[str, Any],
    source_counts: dict[str, dict[str, int]],
    key: str,
    allowed_licenses: list[str],
    allow_nc: bool,
    self_written_sha256: str | None = None,
) -> dict[str, Any]:
    """The whole verdict as data, from the license manifest (read from ``path``), the data
    revision generate read, the rows and tokens of each source, and the verifier's key (and
    the sha256 of the prompt file the verifier wrote, if any): per-source verdicts, failures,
    and the drafter's derived license."""
    allowed = {LICENSING.parse(x).render() for x in allowed_licenses}
    failures: list[str] = []

    dataset_name, revision = data_rev["dataset"], pinned_revision(data_rev)
    dataset_entry = manifest.datasets.get(dataset_name)
    dataset_report: dict[str, Any] = {"dataset": dataset_name, "revision": revision}
    if revision is None:
        failures.append(f"dataset {dataset_name}: not pinned; set data.revision to a Hub commit")
    if dataset_entry is None:
        failures.append(
            f"dataset {dataset_name}: missing from {path} (datasets:); add it with its license, "
            "revision, evidence and provenance"
        )
    else:
        verdict = judge(dataset_entry, allowed, allow_nc)
        dataset_report |= _entry_report(dataset_entry, verdict)
        failures += [f"dataset {dataset_name}: {r}" for r in verdict.reasons]
        if revision is not None and dataset_entry.revision != revision:
            failures.append(
                f"dataset {dataset_name}: generate read revision {revision}, but {path} vouches "
                f"for {dataset_entry.revision}; review that revision's license, then update it"
            )

    sources = []
    non_commercial: dict[str, str] = {}
    verifier_entry = manifest.verifiers.get(key)
    for source, counts in source_counts.items():
        if source == SELF_WRITTEN_SOURCE:  # the verifier wrote these prompts: its terms hold
            report, reasons, nc = self_written_report(verifier_entry, key, allowed, allow_nc)
            report["revision"] = f"sha256:{self_written_sha256}" if self_written_sha256 else "-"
            failures += [f"source {source!r} ({counts['rows']} rows): {r}" for r in reasons]
            if nc:
                non_commercial[source] = nc
            sources.append({**report, **counts})
            continue
        entry = manifest.sources.get(source)
        if entry is None:
            failures.append(
                f"source {source!r} ({counts['rows']} rows): missing from {path} (sources:); "
                "add its dataset, revision, license, evidence and provenance"
            )
            sources.append({"source": source, **counts, "ok": False, "reasons": ["not listed"]})
            continue
        verdict = judge(entry, allowed, allow_nc)
        failures += [f"source {source!r} ({counts['rows']} rows): {r}" for r in verdict.reasons]
        if verdict.ok and verdict.non_commercial:
            non_commercial[source] = str(verdict.spdx)
        sources.append(
            {"source": source, "dataset": entry.dataset, **counts, **_entry_report(entry, verdict)}
        )

    drafter = None
    verifier_report: dict[str, Any] = {"verifier": key}
    if verifier_entry is None:
        failures.append(
            f"verifier {key}: missing from {path} (verifiers:); the drafter inherits it"
        )
    else:
        verifier_spdx, why_not = spdx_of(verifier_entry)
        verifier_report |= {
            "license": verifier_entry.license,
            "spdx": verifier_spdx,
            "license_file": verifier_entry.license_file,
            "evidence": verifier_entry.evidence,
        }
        if verifier_spdx is None:
            failures.append(f"verifier {key}: {why_not}")
        else:
            drafter = derive_drafter_license(verifier_entry, verifier_spdx, non_commercial)
            drafter["license_file"] = verifier_entry.license_file
    return {
        "passed": not failures,
        "failures": failures,
        "license_manifest": str(path),
        "allowed_licenses": sorted(allowed),
        "allow_non_commercial": allow_nc,
        "dataset": dataset_report,
        "sources": sources,
        "totals": {
            k: sum(s.get(k, 0) for s in sources)
            for k in ("rows", "skipped_rows", "prompt_tokens", "completion_tokens")
        },
        "verifier": verifier_report,
        "drafter_license": drafter,
    }


def self_written_report(
    verifier: VerifierLicense | None, key: str, allowed: set[str], allow_nc: bool
) -> tuple[dict[str, Any], list[str], str | None]:
    """Prompts the verifier wrote itself, licensed as the verifier: (report, reasons it fails,
    its SPDX when non-commercial)."""
    report = {
        "source": SELF_WRITTEN_SOURCE,
        "dataset": f"written by {key}",
        "written_by": key,
        "provenance": "prompts the verifier wrote itself from its chat template's user-turn "
        "prefix (the Magpie method); no third party's text",
    }
    if verifier is None:
        return report | {"ok": False}, [f"written by verifier {key}, which is not listed"], None
    verdict = judge(verifier, allowed, allow_nc)
    nc = str(verdict.spdx) if verdict.ok and verdict.non_commercial else None
    return _entry_report(verifier, verdict) | report, verdict.reasons, nc


def _entry_report(entry: _Entry, verdict: Verdict) -> dict[str, Any]:
    return {
        "revision": getattr(entry, "revision", None),
        "license": entry.license,
        "license_name": entry.license_name,
        "declared_by": entry.declared_by,
        "spdx": verdict.spdx,
        "non_commercial": verdict.non_commercial,
        "ok": verdict.ok,
        "reasons": verdict.reasons,
        "evidence": entry.evidence,
        "provenance": getattr(entry, "provenance", None),
    }
