"""`prescient` as its console script runs it, in a child process: for the tests of what only a real
process shows (its exit status, signals, resource limits)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prescient(*args: object, file_limit: int | None = None, wait: bool = True
              ) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run `prescient ARGS` (stdout and stderr as text); with `file_limit`, no file it writes may grow
    past that many bytes (`ulimit -f`: a write past it fails with EFBIG, as one on a full disk fails with
    ENOSPC; Python ignores SIGXFSZ). `wait` False: the started process, its stderr a pipe."""
    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    argv = [sys.executable, "-m", "cli.main", *map(str, args)]
    options = dict(cwd=ROOT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   preexec_fn=limit_files if file_limit is not None else None)
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **options)
    return subprocess.run(argv, capture_output=True, timeout=600, check=False, **options)


def error_line(stderr: str) -> str:
    """The one `error:` line of a command's stderr, which must hold no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]
