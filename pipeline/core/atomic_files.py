"""Atomic file writes with a free-space reserve: readers see the old file or the whole new one.

Every file a later stage reads (manifests, hidden-state shards, conversation lists) is written
here: a temporary file in the same folder, fsync, rename over the target, fsync of the folder.
A crash or a full disk leaves at most a ``.*.tmp`` file, never a short file under the real name.

Deliberately free of heavy imports: vLLM worker processes import it through the hidden-state
connector.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


class ReserveExceededError(OSError):
    """Writing would leave less free space than the reserve; nothing was written."""

    def __init__(self, path: Path, needed: int, free: int, reserve: int):
        super().__init__(
            errno.ENOSPC,
            f"writing {needed} bytes would leave {free - needed} of the {reserve} bytes that "
            f"must stay free on the volume of {path.parent}",
        )
        self.needed, self.free, self.reserve = needed, free, reserve


def existing_folder(path: Path) -> Path:
    """``path``, or its nearest existing parent: the folder that tells which volume it is on."""
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    return probe


def free_bytes(path: Path) -> int:
    """Free bytes on the volume that holds (or will hold) ``path``."""
    return shutil.disk_usage(existing_folder(path)).free


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(
    path: Path, needed: int, reserve_bytes: int, write: Callable[[str], None]
) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then fsync, rename over ``path``
    and fsync the folder; refuse first if ``needed`` bytes would cross ``reserve_bytes``. On
    any failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if reserve_bytes:
        free = free_bytes(path.parent)
        if free - needed < reserve_bytes:
            raise ReserveExceededError(path, needed, free, reserve_bytes)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, reserve_bytes: int = 0) -> None:
    """Write ``data`` to ``path`` atomically; refuse first if it would cross ``reserve_bytes``."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    write_atomically(path, len(data), reserve_bytes, write)


HEADER_ALLOWANCE = 1 << 16  # a safetensors header: a few hundred bytes per tensor, at most


def save_tensors_atomically(tensors: dict, path: Path, reserve_bytes: int = 0) -> int:
    """Write ``tensors`` as safetensors to ``path`` atomically; return the file's bytes.

    safetensors writes the file itself (``save_file``): serialising to a bytes object first
    and writing that copies every shard once more in memory, which was half the writer's time
    against ``dd`` (``make bench``)."""
    from safetensors.torch import save_file  # here: torch is heavy and most callers lack it

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp)
        except OSError:
            raise
        except Exception as err:  # safetensors reports a failed write as its own error type
            code = errno.ENOSPC if "No space left" in str(err) else errno.EIO
            raise OSError(code, f"writing {path}: {err}") from err

    needed = sum(t.numel() * t.element_size() for t in tensors.values()) + HEADER_ALLOWANCE
    write_atomically(path, needed, reserve_bytes, write)
    return Path(path).stat().st_size


def save_figure_atomically(fig: Any, path: Path) -> None:
    """Lay out a matplotlib figure, write it to ``path`` as PNG atomically, and close it."""
    import matplotlib.pyplot as plt  # here: only the stages that plot need matplotlib

    fig.tight_layout()
    try:
        write_atomically(path, 0, 0, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def remove_temporaries(folder: Path) -> int:
    """Delete the ``.*.tmp`` files an interrupted writer left in ``folder``; return the count."""
    removed = 0
    for tmp in Path(folder).glob(f".*{TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()
