"""A real stage with server.runtime=docker: `generate` starts the real vLLM (CPU build) through
the docker SDK against the stand-in Engine API, regenerates, and the container is gone after.

The stand-in runs the container's entrypoint and command on this machine, with this
checkout's Python in place of the image's ``python3`` and the repository on PYTHONPATH as the
image has it, so the command line under test is exactly what the image would run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from pipeline.serving.server_container import ENTRYPOINT
from tests.fake_docker_engine import FakeDockerEngine, Image
from tests.helpers import run_stage, seed_run_dir

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
SAMPLES = 6


def this_machine_as_the_image(cmd: list[str]) -> list[str]:
    assert cmd[0] == ENTRYPOINT[0] == "python3"
    return [sys.executable, *cmd[1:]]


def test_generate_runs_its_vllm_server_as_a_container(tiny_run, tmp_path):
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"data.max_samples={SAMPLES}",
        "server.runtime=docker",
        "server.container.image=eagle3-release:test",
        "server.container.gpus=none",
        "server.startup_timeout_s=600",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier",))
    image = Image(argv=this_machine_as_the_image, env={"PYTHONPATH": str(REPO)})
    with FakeDockerEngine(tmp_path / "engine.sock", {"eagle3-release:test": image}) as engine:
        token = {"HF_TOKEN": "hf_not_for_containers_0123456789"}
        proc = run_stage(
            "pipeline.generate",
            *overrides,
            env={"DOCKER_HOST": engine.docker_host, **token},
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        (body,) = engine.bodies("/containers/create")
        assert engine.containers == {}
        assert not any("hf_not_for_containers" in raw for _, _, raw in engine.requests)
    assert body["Image"] == "eagle3-release:test" and body["Entrypoint"] == ENTRYPOINT
    assert body["HostConfig"]["NetworkMode"] == "host"
    manifest = json.loads((profile.run.run_dir / "generate" / "manifest.json").read_text())
    assert manifest["counts"]["succeeded"] + manifest["counts"]["skipped"] == SAMPLES
    log = (profile.run.run_dir / "generate" / "vllm.log").read_text()
    assert "Application startup complete" in log  # the container's log, kept after removal
