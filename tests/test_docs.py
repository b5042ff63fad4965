"""The docs: results pages equal what their JSONs render to, every public function on the API page
has a docstring, the site builds with `mkdocs build --strict` (no broken link or reference), and
the README stays a short front page that keeps its two commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from experiments.report import ROOT, render_all, stale

API_PAGE = ROOT / "docs" / "api.md"


def test_results_pages_are_what_their_jsons_render_to():
    pages = render_all()
    assert pages, "no results page is defined"
    differ = [str(p.relative_to(ROOT)) for p in stale(pages)]
    assert not differ, f"{differ} differ from what their JSONs render to: run `prescient report` and commit"


def _api_entries() -> list[tuple[str, dict]]:
    """Each `::: path` of the API page with its mkdocstrings options."""
    entries, text = [], API_PAGE.read_text()
    for match in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", text, flags=re.M):
        block = yaml.safe_load(textwrap.dedent(match.group(2))) if match.group(2) else {}
        entries.append((match.group(1), (block or {}).get("options", {})))
    return entries


def test_every_public_function_on_the_api_page_has_a_docstring():
    import griffe

    entries = _api_entries()
    assert len(entries) >= 6
    undocumented = []
    for path, options in entries:
        package, _, rest = path.partition(".")
        obj = griffe.load(package, search_paths=[str(ROOT)])[rest] if rest else griffe.load(package, search_paths=[str(ROOT)])
        if not obj.docstring:
            undocumented.append(path)
        members = options.get("members", True)
        if obj.is_class and members is not False:
            names = members if isinstance(members, list) else [n for n in obj.members if not n.startswith("_")]
            undocumented += [f"{path}.{n}" for n in names if obj.members[n].is_function and not obj.members[n].docstring]
    assert not undocumented, f"public functions on docs/api.md without a docstring: {undocumented}"


def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # not --quiet: it hides warnings
    assert done.returncode == 0, f"mkdocs build --strict failed (install `.[test]`):\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert (tmp_path / "api" / "index.html").exists()


def test_readme_is_short_keeps_its_commands_and_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    head = "\n".join(text.splitlines()[:20])
    assert "pip install -e . && prescient demo --out runs/demo" in head
    assert 'pip install -e ".[test]" && python -m pytest -q' in head
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
