"""Progress bars for long stages: rate and ETA on a terminal, quiet in logs and CI.

Set ``PROGRESS=1`` to force bars on (e.g. under ``docker compose`` without a TTY), ``PROGRESS=0``
to force them off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from tqdm.auto import tqdm


def progress_enabled() -> bool:
    forced = os.environ.get("PROGRESS")
    if forced is not None:
        return forced not in ("0", "false", "")
    return sys.stderr.isatty()


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("smoothing", 0.1)
    return tqdm(iterable, disable=not progress_enabled(), **kwargs)


@contextlib.contextmanager
def watch(
    count: Callable[[], int],
    total: int | Callable[[], int | None],
    interval_s: float = 1.0,
    **kwargs: Any,
):
    """Show a bar for work another process does, polling ``count()`` every ``interval_s``.

    ``total`` may be a callable when only the other process knows it (None until it does).
    """
    total_now: Callable[[], int | None] = total if callable(total) else lambda: total
    bar = progress(total=total_now(), **kwargs)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            with contextlib.suppress(OSError, ValueError):
                if (n := total_now()) is not None and n != bar.total:
                    bar.total = n
                    bar.refresh()
                bar.update(count() - bar.n)

    thread = threading.Thread(target=poll, daemon=True)
    if not bar.disable:
        bar.update(count())
        thread.start()
    try:
        yield bar
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        bar.close()


def byte_size(n: float) -> str:
    """Bytes as people read them, in powers of 1000: 5.73 TB, 80.48 GB, 512 B."""
    for unit, scale in (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"
