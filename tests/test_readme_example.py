"""The README's Python example runs as written, on a tiny model and predictor the tests build in
place of the demo's, and the names it imports are the package's public API."""

from __future__ import annotations

import re

import offload_runtime
from experiments.report import ROOT
from tests.conftest import random_sida


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"--8<-- \[start:python\] -->\n```python\n(.*?)```", text, flags=re.S)
    assert block, "the README has no Python example between its python markers"
    return block.group(1)


def test_the_readme_python_example_runs(tiny_moe_dir, tmp_path, capsys):
    model_dir = tiny_moe_dir("mixtral")
    predictor = random_sida(model_dir, tmp_path, horizon=2)
    code = readme_example()
    line = 'M, P = "runs/demo/model", "runs/demo/predictor/sida"'
    assert line in code
    exec(compile(code.replace(line, f"M, P = {str(model_dir)!r}, {str(predictor)!r}"), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip() and 0.0 <= float(printed.split()[-1]) <= 1.0  # the text, then the hit rate


def test_the_public_api_is_exported_with_docstrings():
    for name in offload_runtime.__all__:
        assert getattr(offload_runtime, name).__doc__, f"offload_runtime.{name} has no docstring"
