"""A Hub verifier fetched before any server starts, and its remote code checked before it runs.

Invariants:
- :func:`download` leaves the whole snapshot (weights, config, remote code) of one commit in the
  HF cache before the verifier stage writes its manifest, so that a server's
  ``startup_timeout_s`` covers loading only (Kimi-K2.5: 540 GB, about 22 minutes to load). It
  is huggingface_hub's own ``snapshot_download``: progress bars with rate and ETA, a partial
  download resumed by the next run, Xet or hf_transfer where installed. It refuses, before
  downloading, a snapshot that does not fit in the cache's free space. The manifest records
  the commit and the bytes; servers then resolve the id offline (``vllm_env``), to that commit.
- :func:`remote_code_import_problems` reads the module-level imports of the files
  ``trust_remote_code`` runs (those ``auto_map`` names, and their sibling modules) and tries each
  against the installed packages, so that a tokenizer written for another transformers release
  is refused in one line naming the import and where it moved, instead of failing inside a
  server start.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.errors import PipelineError
from pipeline.core.progress import byte_size

log = logging.getLogger(__name__)

# Names transformers moved, as remote code written for older releases imports them.
MOVED = {
    ("transformers.models.gpt2.tokenization_gpt2", "bytes_to_unicode"): (
        "transformers.convert_slow_tokenizer"
    ),
}


class SnapshotError(PipelineError):
    """The snapshot cannot be had here; the message names the repository, the commit and the fix."""


@dataclass(frozen=True)
class Snapshot:
    folder: Path
    commit: str
    files: int
    bytes: int


def _snapshot(folder: Path) -> Snapshot:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return Snapshot(folder, folder.name, len(files), sum(p.stat().st_size for p in files))


def download(model: str, revision: str | None) -> Snapshot:
    """The snapshot of ``model`` at ``revision`` (a branch, tag or commit; None: main), in the
    HF cache, complete. Offline (or with the Hub unreachable) a snapshot already cached for
    that revision is used as it is."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        info = HfApi().model_info(model, revision=revision, files_metadata=True)
    except Exception as err:  # offline, unreachable, gated, missing: the cache may still serve
        try:
            folder = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:
            raise SnapshotError(
                f"could not download the verifier {model!r} (revision {revision or 'main'}): "
                f"{type(err).__name__}: {err}. Rerun once the Hub is reachable (HF_TOKEN for a "
                "gated model; a partial download resumes), or point verifier.model at a local "
                "folder"
            ) from err
        log.info("the Hub is not reachable (%s); using the cached snapshot %s", err, folder)
        return _snapshot(folder)
    total = sum(s.size or 0 for s in info.siblings or ())
    cache = Path(HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    have = _cached_bytes(cache, model, info.sha)
    free = shutil.disk_usage(cache).free
    if total - have > free:
        raise SnapshotError(
            f"{model} at {info.sha}: {byte_size(total - have)} still to download into the HF "
            f"cache {cache}, {byte_size(free)} free there: free space, or set HF_HOME "
            "(HF_HUB_CACHE) to a larger volume and rerun (what is downloaded already is kept)"
        )
    log.info("downloading %s at %s: %s (%s cached already)", model, info.sha, byte_size(total),
             byte_size(have))  # fmt: skip
    # By commit, so that what lands is the commit the sizes were read from, whatever main does
    # meanwhile; the ref (main, a tag) is recorded for offline lookups of the id.
    folder = Path(snapshot_download(model, revision=info.sha))
    _record_ref(cache, model, revision or "main", info.sha)
    return _snapshot(folder)


def _record_ref(cache: Path, model: str, ref: str, commit: str) -> None:
    """``refs/<ref>`` -> ``commit``, as huggingface_hub writes it when it downloads a ref."""
    if ref == commit:
        return
    path = cache / f"models--{model.replace('/', '--')}" / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, commit.encode())


def _cached_bytes(cache: Path, model: str, commit: str) -> int:
    """Bytes of ``model`` at ``commit`` already complete in the cache (a rerun's head start)."""
    snapshot = cache / f"models--{model.replace('/', '--')}" / "snapshots" / commit
    if not snapshot.is_dir():
        return 0
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())


def _import_problem(module: str, name: str | None) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # any failure to import is the finding
        return f"{type(err).__name__}: {err}"
    if name is None or name == "*" or hasattr(mod, name):
        return None
    with contextlib.suppress(Exception):
        importlib.import_module(f"{module}.{name}")
        return None
    return f"{module} has no {name}"


def remote_code_files(folder: Path) -> list[Path]:
    """The files ``trust_remote_code`` runs: those ``auto_map`` names in config.json and
    tokenizer_config.json (``"tokenization_kimi.TikTokenTokenizer"``), and the sibling modules
    they import (``from .encoding import ...``)."""
    named: list[str] = []
    for config in ("config.json", "tokenizer_config.json"):
        with contextlib.suppress(OSError, ValueError):
            for ref in json.loads((folder / config).read_text()).get("auto_map", {}).values():
                named += [r for r in (ref if isinstance(ref, list) else [ref]) if r]
    todo = [r.split("--")[-1].rsplit(".", 1)[0] for r in named]  # "repo--module.Class"
    files: list[Path] = []
    while todo:
        path = folder / f"{todo.pop().replace('.', '/')}.py"
        if path in files or not path.is_file():
            continue
        files.append(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return sorted(files)


def remote_code_import_problems(folder: Path) -> list[str]:
    """One line per unconditional import of ``folder``'s remote code (:func:`remote_code_files`)
    that fails against the installed packages, naming the file, the import and, for a known
    move, where the name is now."""
    import transformers

    problems = []
    for path in remote_code_files(folder):
        # Module-level statements only: an import under an ``if``, in a ``try`` or in a function
        # is one of several ways to find a name, or taken only when a feature is there
        # (``if is_flash_attn_2_available(): from flash_attn import ...``).
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    continue  # a sibling module: checked as a file of its own
                wanted = [(node.module, alias.name) for alias in node.names]
            else:
                wanted = [(alias.name, None) for alias in node.names]
            for module, name in wanted:
                if (why := _import_problem(module, name)) is None:
                    continue
                line = f"{path.name}:{node.lineno}: {ast.unparse(node)} fails ({why})"
                if moved := MOVED.get((module, name)):
                    line += (
                        f"; transformers {transformers.__version__} has {name} in {moved}: pin "
                        "verifier.revision to a commit whose code imports it from there"
                    )
                problems.append(line)
    return problems
