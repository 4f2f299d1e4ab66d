"""`make publish` against a local Hub: huggingface_hub's real HTTP client, a real tiny run.

The local Hub (tests/local_hub.py) records every request, so these tests assert what was
committed, that a second publish commits nothing, and where the token went.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from pipeline.config import load_profile
from pipeline.manifest import DRAFTER_FILES, drafter_digest, read_manifest, stage_dir
from tests.helpers import TEST_OVERRIDES, seed_run_dir
from tests.local_hub import LocalHub

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
REPO_ID = "alice/tiny-eagle3"
TOKEN = f"hf_local_{secrets.token_hex(16)}"
FINISHED = ("verifier", "generate", "licenses", "train", "eval", "card")


def overrides(out: Path) -> list[str]:
    return [f"run.output_dir={out}", *TEST_OVERRIDES, f"release.repo_id={REPO_ID}"]


@pytest.fixture
def release_run(tiny_run, tmp_path):
    """A copy of the tiny run's finished stages, to publish to REPO_ID."""
    out = tmp_path / "runs"
    profile = load_profile(REPO / "configs/tiny.yaml", overrides(out))
    seed_run_dir(tiny_run, profile, FINISHED)
    # The card reads only extract's manifest, not its hidden states.
    (profile.run.run_dir / "extract").mkdir()
    shutil.copy2(stage_dir(tiny_run, "extract") / "manifest.json", stage_dir(profile, "extract"))
    return profile


def hub_env(endpoint: str, home: Path, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),  # an empty cache: no token there
        "HF_HUB_DISABLE_XET": "1",  # the local Hub stores large files through git-LFS
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": str(REPO),
    }
    if token:
        env["HF_TOKEN"] = token
    return env


def stage(module: str, profile, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", module, "--config", "configs/tiny.yaml", *flags),
            *overrides(profile.run.output_dir),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_hero_run_ends_with_a_dry_run_of_the_release(tiny_run):
    publish = read_manifest(tiny_run, "publish")["outputs"]
    assert publish["mode"] == "dry-run" and publish["token"] is None
    release = stage_dir(tiny_run, "publish") / "release"
    shipped = {p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()}
    assert shipped == set(publish["files"])
    assert {*DRAFTER_FILES, "README.md", "LICENSE", "data_licenses.json"} <= shipped
    assert {"eval/results.json", "manifests/train.json", "manifests/licenses.json"} <= shipped
    assert {p for p in shipped if p.endswith(".png")} == set(
        read_manifest(tiny_run, "card")["outputs"]["plots"]
    )
    assert (release / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes()
    assert drafter_digest(release) == read_manifest(tiny_run, "eval")["outputs"]["drafter_sha256"]
    assert [s["rows"] for s in publish["data"]] == [40] * 8  # per-source counts in the manifest


def test_publish_pushes_once_then_changes_nothing(release_run, tmp_path):
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", TOKEN)
        stale = stage("release.publish", release_run, env, "--push")
        assert stale.returncode == 2 and "rerun `make card`" in stale.stderr, stale.stderr
        assert stage("model_card.render", release_run, env).returncode == 0

        first = stage("release.publish", release_run, env, "--push")
        assert first.returncode == 0, first.stderr[-3000:]
        repo = hub.repos[REPO_ID]
        commits = len(repo.commits)
        second = stage("release.publish", release_run, env, "--push")
        assert second.returncode == 0, second.stderr[-3000:]
        assert "already up to date" in second.stdout
        assert len(repo.commits) == commits == 2  # the repository's first commit, then ours

        # A file an earlier release had and this one does not is removed by the next publish.
        upload = (
            "from huggingface_hub import HfApi; HfApi().upload_file(path_or_fileobj=b'old', "
            f"path_in_repo='old_plot.txt', repo_id='{REPO_ID}')"
        )
        subprocess.run([sys.executable, "-c", upload], env=env, check=True, timeout=60)
        third = stage("release.publish", release_run, env, "--push")
        assert third.returncode == 0, third.stderr[-3000:]
    assert len(repo.commits) == 4 and "old_plot.txt" not in repo.head.files

    release = stage_dir(release_run, "publish") / "release"
    files = [p for p in release.rglob("*") if p.is_file()]
    local = {p.relative_to(release).as_posix(): p.read_bytes() for p in files}
    assert repo.private
    assert {k: v for k, v in repo.head.files.items() if k != ".gitattributes"} == local
    assert "model.safetensors" in repo.head.lfs  # the weights went through git-LFS
    git_sha = read_manifest(release_run, "train")["git"]["sha"]
    assert git_sha[:12] in repo.head.title

    card = ModelCard(repo.head.files["README.md"].decode())
    summary = read_manifest(release_run, "eval")["outputs"]["summary"]
    assert card.data.license == "apache-2.0"
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics["mean_acceptance_length"] == round(summary["mean_acceptance_length"], 4)
    assert f'"model": "{REPO_ID}"' in card.text  # the serve command names the pushed repo

    outputs = read_manifest(release_run, "publish")["outputs"]
    assert outputs["mode"] == "push" and outputs["changed"] == ["old_plot.txt"]
    assert outputs["remote_head"] == repo.head.oid
    assert outputs["remote_check"] == {"files": len(local), "matched": len(local)}

    # The token went only into Authorization headers, and was written nowhere.
    assert any(r["headers"].get("Authorization") == f"Bearer {TOKEN}" for r in hub.requests)
    for request in hub.requests:
        assert TOKEN not in request["url"] and TOKEN.encode() not in request["body"]
        assert all(TOKEN not in v for k, v in request["headers"].items() if k != "Authorization")
    logs = [p.stdout + p.stderr for p in (first, second, third)]
    assert all(TOKEN not in log for log in logs)
    for folder in (release_run.run.run_dir, tmp_path / "hf-home"):
        for path in folder.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path


def retrain(profile) -> None:
    """Replace the drafter by a different checkpoint, as a second training run would."""
    manifest_path = stage_dir(profile, "train") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    retrained = stage_dir(profile, "train") / "retrained"
    shutil.copytree(manifest["outputs"]["drafter"], retrained)
    weights = load_file(retrained / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, retrained / "model.safetensors")
    manifest["outputs"] |= {"drafter": str(retrained), "drafter_sha256": drafter_digest(retrained)}
    manifest_path.write_text(json.dumps(manifest))


def fail_license_check(profile, tmp_path) -> None:
    licenses = tmp_path / "licenses.yaml"
    text = (REPO / "release/licenses.yaml").read_text()
    licenses.write_text(text.replace("tiny-blend/math: *tiny-blend", ""))
    from release.check_licenses import LicenseCheckError, run

    with pytest.raises(LicenseCheckError):
        run(
            load_profile(
                REPO / "configs/tiny.yaml",
                [*overrides(profile.run.output_dir), f"release.licenses_file={licenses}"],
            )
        )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no token", "no Hugging Face token: set HF_TOKEN"),
        ("rejected token", "the Hub refused a request for alice/tiny-eagle3: 401"),
        ("license check failed", "the license check failed for this run: source 'tiny-blend/math'"),
        ("no eval", "no eval results for run 'tiny': run `make eval`"),
        ("eval of another checkpoint", "the eval results belong to drafter checkpoint"),
    ],
)
def test_publish_refuses_and_says_why(release_run, tmp_path, case, message):
    token = {"no token": None, "rejected token": "hf_not_a_token"}.get(case, TOKEN)
    if case == "license check failed":
        fail_license_check(release_run, tmp_path)
    elif case == "no eval":
        shutil.rmtree(stage_dir(release_run, "eval"))
    elif case == "eval of another checkpoint":
        retrain(release_run)
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", token)
        if case != "no eval":  # the card for REPO_ID, so that only `case` is wrong
            assert stage("model_card.render", release_run, env).returncode in (0, 2)
        refused = stage("release.publish", release_run, env, "--push")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert message in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert REPO_ID not in hub.repos or len(hub.repos[REPO_ID].commits) == 1
    if token:
        assert token not in refused.stdout + refused.stderr
