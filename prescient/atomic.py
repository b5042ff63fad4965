"""Atomic file writes: a reader sees the old file or the whole new one, never half of one."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it onto the target on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)` and move the result onto `target` atomically."""
    with atomic_path(target) as tmp:
        write(tmp)
    return Path(target)


def write_json_atomic(target: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON, atomically."""
    return write_atomic(target, lambda p: p.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n"))


def write_results(result: Any, json_path: str | os.PathLike, plot_path: str | os.PathLike | None = None,
                  plot: Callable[[Any, str | os.PathLike], object] | None = None) -> None:
    """An experiment's JSON, and its PNG drawn by `plot(result, path)` when `plot_path` is given;
    both written atomically."""
    write_json_atomic(json_path, result)
    log.info("results written to %s", json_path)
    if plot_path and plot is not None:
        plot(result, plot_path)
        log.info("plot written to %s", plot_path)
