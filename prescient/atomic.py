"""Atomic file writes: a reader sees the old file or the whole new one, never half of one.

Where a write lands (`resolve_output`): a symlink is written through to its target (the link
stays); a character device (`/dev/null`, a terminal) and the process's own streams
(`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`) are written in place, appended to, never replaced;
a directory, a FIFO, a socket or a block device is refused with `OutputPathError`. Commands
check their output paths with `resolve_output` before any work starts. A write that fails (a full
disk, a file-size limit, a read-only file system) is an `OutputWriteError` naming the path and the
cause (`write_errors`), and leaves the target as it was.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from prescient.errors import OutputPathError, OutputWriteError

log = logging.getLogger(__name__)

_STREAM = re.compile(r"^/dev/(stdout|stderr|fd/\d+)$|^/proc/self/fd/\d+$")
_OS_ERROR = re.compile(r"os error (\d+)")  # how safetensors' Rust side names the OS error it met
_NOT_A_FILE = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
               stat.S_ISBLK: "a block device"}


def resolve_output(target: str | os.PathLike) -> tuple[Path, bool]:
    """(the path a write to `target` lands on, whether it is written in place rather than
    replaced); `OutputPathError` when `target` cannot be written as a file."""
    path = Path(target)
    if _STREAM.match(os.path.abspath(path)):
        return path, True
    try:
        mode = os.stat(path).st_mode  # follows symlinks
    except FileNotFoundError:
        real = Path(os.path.realpath(path))  # a dangling link: its target is created
        check_folder(real.parent, path)
        return real, False
    except NotADirectoryError:
        raise OutputPathError(f"output {path}: part of its folder path is a file; choose another path") from None
    except OSError as exc:
        raise OutputPathError(f"output {path} cannot be examined ({exc.strerror}); choose another path") from None
    if stat.S_ISCHR(mode):
        return path, True
    if not stat.S_ISREG(mode):
        kind = next(name for test, name in _NOT_A_FILE.items() if test(mode))
        raise OutputPathError(f"output {path} is {kind}, not a file; name a file to write")
    real = Path(os.path.realpath(path))
    check_folder(real.parent, path)
    return real, False


def check_folder(folder: Path, target: Path) -> None:
    """`folder`, where `target` is written, exists or can be made, and is writable."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"output {target}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"output {target}: folder {existing} is not writable; choose another path")


@contextmanager
def write_errors(target: str | os.PathLike) -> Iterator[None]:
    """Turn a write under `target` that fails (an OSError, or safetensors' error for one) into an
    `OutputWriteError` naming `target`, the cause and the file it failed on."""
    try:
        yield
    except OSError as exc:
        raise OutputWriteError(cannot_write(target, exc.strerror or str(exc), exc.filename)) from exc
    except SafetensorError as exc:
        code = _OS_ERROR.search(str(exc))
        raise OutputWriteError(cannot_write(target, os.strerror(int(code[1])) if code else str(exc))) from exc


def cannot_write(target: str | os.PathLike, cause: str, filename: str | os.PathLike | None = None) -> str:
    """The message of a write to `target` that failed with `cause` (on `filename`, where it differs)."""
    where = f" ({filename})" if filename is not None and os.fspath(filename) != os.fspath(target) else ""
    return f"cannot write {target}: {cause}{where}; free space or choose another path, then run the command again"


@contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success its bytes land on `target` (see
    `resolve_output`): renamed onto a file, or copied into a device or stream."""
    real, in_place = resolve_output(target)
    folder = None if in_place else real.parent
    with write_errors(target):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            yield tmp_path
            if in_place:
                _copy_into(tmp_path, real)
            else:
                os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
                os.replace(tmp_path, real)
        finally:
            tmp_path.unlink(missing_ok=True)


def _copy_into(source: Path, stream: Path) -> None:
    """Append `source` to a device or stream (appending: a shell's `> file` stays intact)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with source.open("rb") as src, stream.open("ab") as dst:
        shutil.copyfileobj(src, dst)


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
