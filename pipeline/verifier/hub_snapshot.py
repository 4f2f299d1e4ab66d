"""A Hub verifier fetched before any server starts, and its remote code checked before it runs.

Invariants:
- :func:`download` leaves the whole snapshot (weights, config, remote code) of one commit in the
  HF cache before the verifier stage writes its manifest, so that a server's
  ``startup_timeout_s`` covers loading only (Kimi-K2.5: 540 GB, about 22 minutes to load). It
  is huggingface_hub's own ``snapshot_download``: progress bars with rate and ETA, a partial
  download resumed by the next run, Xet or hf_transfer where installed. It refuses, before
  downloading, a snapshot that does not fit in the cache's free space. The manifest records
  the commit and the bytes; servers then resolve the id offline (``vllm_env``), to that commit.
- :func:`remote_code_import_problems` reads the imports of the snapshot's ``*.py`` files (the
  code ``trust_remote_code`` runs) and tries each against the installed packages, so that a
  tokenizer written for another transformers release is refused in one line naming the import
  and where it moved, instead of failing inside a server start.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.progress import byte_size

log = logging.getLogger(__name__)

# Names transformers moved, as remote code written for older releases imports them.
MOVED = {
    ("transformers.models.gpt2.tokenization_gpt2", "bytes_to_unicode"): (
        "transformers.convert_slow_tokenizer"
    ),
}


@dataclass(frozen=True)
class Snapshot:
    folder: Path
    commit: str
    files: int
    bytes: int


def download(model: str, revision: str | None) -> Snapshot:
    """The snapshot of ``model`` at ``revision`` (a branch, tag or commit; None: main), in the
    HF cache, complete; the error names the repository, the commit and the fix."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    info = HfApi().model_info(model, revision=revision, files_metadata=True)
    total = sum(s.size or 0 for s in info.siblings or ())
    cache = Path(HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    have = _cached_bytes(cache, model, info.sha)
    free = shutil.disk_usage(cache).free
    if total - have > free:
        raise OSError(
            f"{model} at {info.sha}: {byte_size(total - have)} still to download into the HF "
            f"cache {cache}, {byte_size(free)} free there: free space, or set HF_HOME "
            "(HF_HUB_CACHE) to a larger volume and rerun (what is downloaded already is kept)"
        )
    log.info("downloading %s at %s: %s (%s cached already)", model, info.sha, byte_size(total),
             byte_size(have))  # fmt: skip
    folder = Path(snapshot_download(model, revision=info.sha))
    files = [p for p in folder.rglob("*") if p.is_file()]
    return Snapshot(folder, info.sha, len(files), sum(p.stat().st_size for p in files))


def _cached_bytes(cache: Path, model: str, commit: str) -> int:
    """Bytes of ``model`` at ``commit`` already complete in the cache (a rerun's head start)."""
    snapshot = cache / f"models--{model.replace('/', '--')}" / "snapshots" / commit
    if not snapshot.is_dir():
        return 0
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())


def _guarded_by_import_error(tree: ast.Module) -> set[int]:
    """Line numbers of imports in a ``try: ... except ImportError`` (either branch): one of
    several ways the code finds a name, not a need of its own."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
        if caught & {"ImportError", "ModuleNotFoundError", "Exception"} or any(
            h.type is None for h in node.handlers
        ):
            for stmt in [*node.body, *(s for h in node.handlers for s in h.body)]:
                for inner in ast.walk(stmt):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        lines.add(inner.lineno)
    return lines


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


def remote_code_import_problems(folder: Path) -> list[str]:
    """One line per import of ``folder``'s remote code that fails against the installed
    packages, naming the file, the import and (for a known move) where the name is now."""
    import transformers

    problems = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        fallbacks = _guarded_by_import_error(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in fallbacks:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                wanted = [(alias.name, None) for alias in node.names]
            else:
                continue
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
