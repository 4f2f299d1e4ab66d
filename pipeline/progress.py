"""Progress bars for long stages: rate and ETA on a terminal, quiet in logs and CI.

Set ``PROGRESS=1`` to force bars on (e.g. under ``docker compose`` without a TTY), ``PROGRESS=0``
to force them off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
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
