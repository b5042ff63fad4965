"""`prescient COMMAND --help` answers without importing torch (seconds on a small machine): what
the flags read from the library (`RuntimeOptions`' names and defaults, the built-in predictors'
names, the batch benches' settings) loads without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
WITH_TORCH = {"train"}  # LightningCLI builds its parser from the LightningModule, which imports torch

PARSE_HELP = """
import contextlib, io, sys
from cli.main import build_parser
parser, _ = build_parser(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):
    parser.parse_args([sys.argv[1], "--help"])
assert "usage: prescient" in shown.getvalue(), shown.getvalue()
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - WITH_TORCH))
def test_help_imports_no_torch(command):
    done = subprocess.run([sys.executable, "-c", PARSE_HELP, command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"`prescient {command} --help` imported {done.stdout.strip()}"
