"""`make publish` against a local Hub: huggingface_hub's real HTTP client, a real tiny run.

The local Hub (tests/local_hub.py) records every request, so these tests assert what was
committed, that a second publish commits nothing, and where the token went. Publish runs as in
production (no HF_HUB_DISABLE_XET here: publish itself chooses the git-LFS upload), and the
local Hub refuses what the real one refuses (card metadata it cannot parse, a stale parent
commit).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from pipeline.core.atomic_files import atomic_write_json, sha256_file
from pipeline.core.config import load_profile
from pipeline.core.drafter import DRAFTER_FILES, drafter_digest
from pipeline.core.manifest import read_manifest, stage_dir
from pipeline.core.portable import portable
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
    # As this version writes them: relative to the run folder, so that they name the copy (a
    # stage the tiny run reused, like its verifier, may have written an older manifest).
    for stage in (*FINISHED, "extract"):
        path = stage_dir(profile, stage) / "manifest.json"
        atomic_write_json(path, portable(tiny_run, json.loads(path.read_text())))
    return profile


def hub_env(endpoint: str, home: Path, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),  # an empty cache: no token there
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
    # per-source counts in the manifest: the conversations generate kept, source by source
    records = map(json.loads, (stage_dir(tiny_run, "generate") / "responses.jsonl").open())
    kept = Counter(r["source"] for r in records if not r.get("skip_reason"))
    assert {s["source"]: s["rows"] for s in publish["data"]} == kept and len(kept) == 8


def test_publish_pushes_once_then_changes_nothing(release_run, tmp_path):
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", TOKEN)
        stale = stage("release.publish", release_run, env, "--push")
        assert stale.returncode == 2 and "rerun `make card`" in stale.stderr, stale.stderr
        assert stage("model_card.card", release_run, env).returncode == 0

        first = stage("release.publish", release_run, env, "--push")
        assert first.returncode == 0, first.stderr[-3000:]
        repo = hub.repos[REPO_ID]
        # One commit on top of the head it compared against; git-LFS, never the Xet routes.
        (sent,) = [r for r in hub.requests if r["method"] == "POST" and "/commit/" in r["url"]]
        assert json.loads(sent["body"].splitlines()[0])["value"]["parentCommit"] == (
            repo.commits[0].oid
        )
        assert any("/info/lfs/objects/batch" in r["url"] for r in hub.requests)
        assert not any("xet" in r["url"].lower() for r in hub.requests)
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
    manifest = read_manifest(profile, "train")  # its paths resolved against this run folder
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
    from release.licenses import LicenseCheckError, run

    with pytest.raises(LicenseCheckError):
        run(
            load_profile(
                REPO / "configs/tiny.yaml",
                [*overrides(profile.run.output_dir), f"release.licenses_file={licenses}"],
            )
        )


def make_license_check_stale(profile) -> None:
    """Regenerate (as far as the manifests tell) after the license check ran."""
    path = stage_dir(profile, "generate") / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["finished_at"] = "2099-01-01T00:00:00+00:00"
    path.write_text(json.dumps(manifest))


def break_card_metadata(profile) -> None:
    """A card whose YAML front matter the Hub cannot parse (as a hand edit might leave it)."""
    card = stage_dir(profile, "card") / "README.md"
    text = card.read_text()
    assert "\nlicense: apache-2.0\n" in text
    card.write_text(text.replace("\nlicense: apache-2.0\n", "\nlicense: [apache-2.0\n", 1))


# What the card stage says about each case: the card must refuse what publish refuses.
CARD_REFUSES = {
    "license check failed": "the license check failed for this run",
    "stale license check": "stage 'licenses' of run 'tiny' is stale: its input 'generate'",
    "eval of another checkpoint": "stage 'eval' of run 'tiny' is stale: its input 'train'",
}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no token", "no Hugging Face token: set HF_TOKEN"),
        ("rejected token", "the Hub refused a request for alice/tiny-eagle3: 401"),
        ("license check failed", "the license check failed for this run: source 'tiny-blend/math'"),
        (
            "stale license check",
            "its input 'generate' was rerun after it finished; rerun `make licenses",
        ),
        ("no eval", "no eval results for run 'tiny': run `make eval`"),
        (
            "eval of another checkpoint",
            "its input 'train' was rerun after it finished; rerun `make eval",
        ),
        (
            "card metadata the Hub cannot parse",
            "the Hub rejected the model card's metadata (README.md): Invalid YAML in README.md",
        ),
    ],
)
def test_publish_refuses_and_says_why(release_run, tmp_path, case, message):
    token = {"no token": None, "rejected token": "hf_not_a_token"}.get(case, TOKEN)
    if case == "license check failed":
        fail_license_check(release_run, tmp_path)
    elif case == "stale license check":
        make_license_check_stale(release_run)
    elif case == "no eval":
        shutil.rmtree(stage_dir(release_run, "eval"))
    elif case == "eval of another checkpoint":
        retrain(release_run)
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", token)
        if case != "no eval":  # the card for REPO_ID, so that only `case` is wrong
            card = stage("model_card.card", release_run, env)
            if case in CARD_REFUSES:
                assert card.returncode == 2, card.stdout + card.stderr
                assert CARD_REFUSES[case] in card.stderr, card.stderr
            else:
                assert card.returncode == 0, card.stderr[-3000:]
        if case == "card metadata the Hub cannot parse":
            break_card_metadata(release_run)
        refused = stage("release.publish", release_run, env, "--push")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert message in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, refused.stderr
    assert REPO_ID not in hub.repos or len(hub.repos[REPO_ID].commits) == 1
    if token:
        assert token not in refused.stdout + refused.stderr


def test_publish_refuses_when_the_repository_changed_meanwhile(release_run, tmp_path):
    """Another writer commits between publish's look at the remote and its commit: the Hub
    refuses the stale parent, and nothing of theirs is overwritten or deleted."""
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", TOKEN)
        assert stage("model_card.card", release_run, env).returncode == 0
        hub.before_commit.append(
            lambda repo: hub.new_commit(
                repo, "someone else", "", {**repo.head.files, "theirs.txt": b"mine"}, repo.head.lfs
            )
        )
        refused = stage("release.publish", release_run, env, "--push")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {REPO_ID} changed while publishing"), refused.stderr
    assert "rerun `make publish PUSH=1`" in last and "Traceback" not in refused.stderr
    repo = hub.repos[REPO_ID]
    assert [c.title for c in repo.commits] == ["initial commit", "someone else"]
    assert repo.head.files["theirs.txt"] == b"mine"


def test_publish_uses_the_token_hf_auth_login_cached(release_run, tmp_path):
    """No HF_TOKEN: the token `hf auth login` stored in the HF cache is found and used, and
    goes into no file of the run."""
    hub = LocalHub({TOKEN: "alice"})
    with hub.running() as endpoint:
        env = hub_env(endpoint, tmp_path / "hf-home", None)
        hf = Path(sys.executable).parent / "hf"
        login = subprocess.run(
            [str(hf), "auth", "login", "--token", TOKEN],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert login.returncode == 0, login.stdout + login.stderr
        assert stage("model_card.card", release_run, env).returncode == 0
        dry = stage("release.publish", release_run, env)
        assert dry.returncode == 0, dry.stderr[-3000:]
        assert "(token from the HF cache)" in dry.stdout
        pushed = stage("release.publish", release_run, env, "--push")
        assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert len(hub.repos[REPO_ID].commits) == 2
    whoami = [r for r in hub.requests if r["url"].startswith("/api/whoami")]
    assert whoami and whoami[-1]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert read_manifest(release_run, "publish")["outputs"]["mode"] == "push"
    for path in release_run.run.run_dir.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def restamp_inputs(profile, stages: tuple[str, ...]) -> None:
    """Record in each of ``stages`` (in pipeline order) its inputs' manifests as they are now,
    as if each had been rerun on them."""
    for name in stages:
        path = stage_dir(profile, name) / "manifest.json"
        manifest = json.loads(path.read_text())
        for needed, record in manifest["inputs"].items():
            record["sha256"] = sha256_file(stage_dir(profile, needed) / "manifest.json")
        path.write_text(json.dumps(manifest))


def test_card_shows_how_the_prompts_were_sampled(release_run, tmp_path):
    env = hub_env("http://127.0.0.1:9", tmp_path / "hf-home", None)  # the card needs no Hub
    path = stage_dir(release_run, "generate") / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["outputs"].pop("sampling", None)  # a manifest from before generate recorded it
    path.write_text(json.dumps(manifest))
    old = stage("model_card.card", release_run, env)
    assert old.returncode == 2
    assert "does not match the 'generate' stage's contract (outputs.sampling" in old.stderr
    assert "rerun `make generate" in old.stderr

    report = json.loads((stage_dir(release_run, "licenses") / "report.json").read_text())
    sources = [s["source"] for s in report["sources"]]
    manifest["outputs"]["sampling"] = {
        "seed": 7,
        "method": "stratified",
        "max_samples": 25 * len(sources),
        "by_source": {source: {"available": 40, "sampled": 25} for source in sources},
    }
    path.write_text(json.dumps(manifest))
    restamp_inputs(release_run, ("licenses", "extract", "train", "eval"))  # as if rerun on it
    card = stage("model_card.card", release_run, env)
    assert card.returncode == 0, card.stderr[-3000:]
    text = " ".join((stage_dir(release_run, "card") / "README.md").read_text().split())
    n, m = 25 * len(sources), 40 * len(sources)
    assert f"Sampling: {n} of {m} rows sampled, stratified by source" in text
    assert f"seed 7 (`data.max_samples={n}`)" in text
    assert all(f"| {source} | 25 | 40 |" in text for source in sources)
    assert f"| **total** | {n} | {m} |" in text


def released_text(path: Path) -> str:
    """What a reader of a released file sees: a safetensors file's JSON header, a PNG's text
    chunks, any other file as text."""
    if path.suffix == ".safetensors":
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            return fh.read(size).decode()
    if path.suffix == ".png":
        from PIL import Image

        with Image.open(path) as image:
            return json.dumps({k: str(v) for k, v in image.info.items()})
    return path.read_text()


def builder_traces(*run_dirs: Path) -> dict[str, re.Pattern]:
    """The builder's home, working directory, checkout, venv and run folders as paths; the user
    name as a path component; the host name as a whole token."""
    paths = {
        "home": Path.home(),
        "working directory": Path.cwd(),
        "checkout": REPO,
        "venv": Path(sys.prefix),
        **{f"run folder {d}": d for d in run_dirs},
    }
    traces = {
        name: re.compile(rf"{re.escape(str(p.absolute()))}(?![\w.-])") for name, p in paths.items()
    }
    user, host = re.escape(getpass.getuser()), re.escape(socket.gethostname())
    traces["user name"] = re.compile(rf"(?:/|~){user}(?![\w.-])")
    traces["host name"] = re.compile(rf"(?<![\w.-]){host}(?![\w.-])")
    return traces


def test_the_release_names_no_path_of_the_builders_machine(tiny_run, release_run, tmp_path):
    """The tiny run's own release (from `make hero-run`) and a dry run of this checkout's card
    and publish on a copy of it: no file names the machine that built them."""
    env = hub_env("http://127.0.0.1:9", tmp_path / "hf-home", None)
    assert stage("model_card.card", release_run, env).returncode == 0
    dry = stage("release.publish", release_run, env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    traces = builder_traces(tiny_run.run.run_dir, release_run.run.run_dir)
    for release in (stage_dir(r, "publish") / "release" for r in (tiny_run, release_run)):
        files = sorted(p for p in release.rglob("*") if p.is_file())
        assert len(files) >= 10
        for path in files:
            text = released_text(path)
            found = {name: m.group(0) for name, t in traces.items() if (m := t.search(text))}
            assert not found, f"{path.relative_to(release)} names {found}"
        card = (release / "README.md").read_text()
        (serve,) = [line for line in card.splitlines() if line.startswith("vllm serve ")]
        assert serve.split()[2] == "verifier/model", serve  # served from the run folder
        assert "The verifier is not on the Hub" in card


def test_publish_refuses_a_release_that_names_a_machine_path(release_run, tmp_path):
    env = hub_env("http://127.0.0.1:9", tmp_path / "hf-home", None)
    assert stage("model_card.card", release_run, env).returncode == 0
    card = stage_dir(release_run, "card") / "README.md"
    card.write_text(card.read_text() + f"\nBuilt in {release_run.run.run_dir.absolute()}/x.\n")
    refused = stage("release.publish", release_run, env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: README.md names a path of this machine"), refused.stderr
    assert "rerun `make card`" in last
    assert not (stage_dir(release_run, "publish") / "release").exists()
