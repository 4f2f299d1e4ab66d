"""The container path for real: `make hero-run RUNNER=compose VARIANT=cpu` on the tiny profile,
on the private Docker engine `make test` starts (tests/docker_engine.py), with the CPU image.

Every stage runs in the `pipeline` container; each vLLM server is a sibling container started
through the docker SDK (server.runtime=docker) from inside it, over the mounted socket, as on
a GPU host. The run is first killed mid-generate (`docker kill` of the pipeline container:
every process in it dies at once, no ``finally`` runs), which must leave no container behind,
then run again: it resumes and produces what the local run produces. Then the serve-profile
services: the verifier answers a chat completion, and `make eval BASE_URL=...` (in the
pipeline container) measures the verifier-plus-drafter deployment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pipeline.serving.server_container import LABEL_RUN
from pipeline.serving.vllm_api import free_port
from tests.listener_guard import ListenerGuard

pytestmark = [pytest.mark.containers, pytest.mark.e2e]
REPO = Path(__file__).parent.parent
STAGES = ("verifier", "generate", "licenses", "extract", "train", "eval", "card", "publish")
# Smaller than the local run's, same code: each eval arm is a container start.
RUN_ARGS = (
    "data.max_samples=48 data.eval_max_samples=8 eval.max_tokens=32 train.epochs=4 "
    "eval.num_speculative_tokens=[1] eval.concurrency=[1] eval.methods=[eagle3]"
)
COMPOSE = ["docker", "compose", "-f", "compose.yaml", "-f", "compose.cpu.yaml"]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.5)


def server_containers(client) -> list:
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN}=tiny"})


def pipeline_containers(client) -> list:
    label = "com.docker.compose.service=pipeline"
    return client.containers.list(all=True, filters={"label": label})


def hero_run(env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = ["make", "hero-run", "RUNNER=compose", "VARIANT=cpu", "CONFIG=configs/tiny.yaml"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*cmd, f"ARGS={RUN_ARGS}"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def engine_processes(engine_dir: str) -> list[int]:
    """The private engine's processes (dockerd, containerd, the shims, whose command lines name
    its folder): roots whose trees hold every container's processes; read from /proc, not asked
    of the engine."""
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(engine_dir in part for part in proc.info["cmdline"] or ()):
            pids.append(proc.pid)
    return pids


@pytest.fixture(scope="module")
def container_listeners(docker_engine):
    """Every listener of this module's runs, watched throughout: the test process's own tree
    (make, docker compose) and each container's (the pipeline's stages, the sibling vLLM
    servers, the serve-profile services), all in the host's network namespace."""
    engine_dir = os.environ["EAGLE3_ENGINE_DIR"]
    with ListenerGuard(lambda: [os.getpid(), *engine_processes(engine_dir)]) as guard:
        yield guard


@pytest.fixture(scope="module")
def compose_run(docker_engine, container_listeners, tiny_verifier, tmp_path_factory):
    """The run killed mid-generate, then run to the end; what each step left. The verifier the
    local run built is copied in (the same recipe: the container's verifier stage reuses it, as
    any rerun does); building it again is four minutes of the same code."""
    root = tmp_path_factory.mktemp("compose")
    data, hf = root / "data", root / "hf"
    shutil.copytree(tiny_verifier.run.run_dir / "verifier", data / "runs" / "tiny" / "verifier",
                    ignore=shutil.ignore_patterns("*.log"))  # fmt: skip
    image_uid = os.getuid() or 1000  # the image's user, as make builds it (root maps to 1000)
    for path in [data, *data.rglob("*")]:
        os.lchown(path, image_uid, -1)
    env = {**os.environ, "DATA_DIR": str(data), "HF_CACHE": str(hf), "PROGRESS": "0"}
    responses = data / "runs" / "tiny" / "generate" / "responses.jsonl"
    facts: dict = {"root": root, "data": data, "env": env}

    first = hero_run(env, root / "first.log")
    try:

        def generating_or_ended() -> bool:
            return (responses.exists() and responses.stat().st_size > 0) or first.poll() is not None

        wait_for(generating_or_ended, 900, "generate's first responses")
        assert first.poll() is None, tail(root / "first.log")
        facts["servers_before_kill"] = [c.name for c in server_containers(docker_engine)]
        (pipeline,) = pipeline_containers(docker_engine)
        pipeline.kill()
        facts["first_status"] = first.wait(timeout=120)
    finally:
        first.kill()
    gone_at = time.monotonic()
    wait_for(lambda: not server_containers(docker_engine), 60, "the server container gone")
    facts["server_gone_after_s"] = round(time.monotonic() - gone_at, 1)
    facts["pipeline_left"] = [c.name for c in pipeline_containers(docker_engine)]
    facts["resumable"] = sum(1 for _ in responses.open())

    started = time.monotonic()
    second = hero_run(env, root / "second.log")
    facts["second_status"] = second.wait(timeout=1800)
    facts["second_s"] = round(time.monotonic() - started)
    facts["log"] = tail(root / "second.log")
    facts["left"] = [c.name for c in docker_engine.containers.list(all=True)]
    print(f"compose tiny run: resumed run {facts['second_s']} s")
    return facts


def test_a_killed_pipeline_container_leaves_no_server_container(compose_run):
    assert compose_run["servers_before_kill"], "generate's server container was running"
    assert compose_run["first_status"] != 0
    assert compose_run["server_gone_after_s"] < 30  # the guard saw the lifeline close
    assert compose_run["pipeline_left"] == []  # `compose run --rm`
    assert compose_run["resumable"] > 0


def test_the_compose_run_resumes_and_makes_what_the_local_run_makes(compose_run, tiny_run):
    assert compose_run["second_status"] == 0, compose_run["log"]
    assert compose_run["left"] == []  # no container of the run, nor the pipeline's
    runs = compose_run["data"] / "runs" / "tiny"
    local = tiny_run.run.run_dir
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    for stage in STAGES:
        ours = json.loads((runs / stage / "manifest.json").read_text())
        theirs = json.loads((local / stage / "manifest.json").read_text())
        assert ours.keys() == theirs.keys(), stage
        assert ours["counts"].keys() == theirs["counts"].keys(), stage
        assert ours["git"]["sha"] == head.stdout.strip()  # passed in: the image has no .git
    generate = json.loads((runs / "generate" / "manifest.json").read_text())["counts"]
    assert generate["input"] == 48 and generate["failed"] == 0
    assert generate["succeeded"] + generate["skipped"] == 48

    def files(folder: Path) -> set[str]:
        return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}

    release = runs / "publish" / "release"
    assert files(release) == files(local / "publish" / "release")
    results = json.loads((runs / "eval" / "results.json").read_text())
    assert results.keys() == json.loads((local / "eval" / "results.json").read_text()).keys()
    card = (release / "README.md").read_text()
    assert f"at git `{head.stdout.strip()[:12]}`" in card
    # The sibling servers ran as the pipeline's user, so the run folder is one owner's.
    owners = {p.stat().st_uid for p in runs.rglob("*") if not p.is_symlink()}
    assert owners == {runs.stat().st_uid}


def compose(env: dict[str, str], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COMPOSE, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_serve_profile_services_answer_and_eval_measures_them(compose_run, docker_engine):
    assert compose_run["second_status"] == 0, compose_run["log"]
    ports = {"VERIFIER_PORT": str(free_port()), "EVAL_PORT": str(free_port())}
    env = {
        **compose_run["env"],
        **ports,
        "CONFIG": "configs/tiny.yaml",
        "IMAGE": "eagle3-release:cpu",
        "HEALTHCHECK_INTERVAL": "3s",
    }
    try:
        up = compose(env, "--profile", "serve", "up", "-d", "--wait", "verifier", "eval")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        reply = httpx.post(
            f"http://127.0.0.1:{ports['VERIFIER_PORT']}/v1/chat/completions",
            json={
                "model": "verifier",
                "messages": [{"role": "user", "content": "Name a prime number."}],
                "max_tokens": 16,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]
        base_url = f"http://127.0.0.1:{ports['EVAL_PORT']}"
        measured = compose(
            env,
            "run",
            "--rm",
            "pipeline",
            "eval",
            "CONFIG=configs/tiny.yaml",
            f"BASE_URL={base_url}",
            f"ARGS=run.output_dir=/data/runs {RUN_ARGS}",
        )
        assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
    finally:
        down = compose(env, "--profile", "serve", "down", "--timeout", "30")
        assert down.returncode == 0, down.stderr[-2000:]
    results = json.loads(
        (compose_run["data"] / "runs" / "tiny" / "eval" / "results.json").read_text()
    )
    (served,) = [r for r in results["runs"] if r["method"] == "served"]
    acceptance = served["levels"][0]["acceptance"]
    assert acceptance["num_speculative_tokens"] >= 1 and acceptance["drafts"] > 0  # the drafter
    assert docker_engine.containers.list(all=True) == []


def test_no_container_listened_beyond_loopback(compose_run, container_listeners):
    """After the killed run, the resumed run and the serve-profile services (tests above)."""
    container_listeners.check("the container runs")
    assert any("vllm" in listener.process.lower() for listener in container_listeners.seen.values())
