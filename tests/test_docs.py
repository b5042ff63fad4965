"""The docs: results pages equal what their JSONs render to, every public function on the API page
has a docstring, the site builds with `mkdocs build --strict` (no broken link or reference; a
broken one fails it), the commands page lists every command, and the README stays a short front
page that keeps its two commands."""

from __future__ import annotations

import os
import re
import shutil
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


def _strict_build(root: Path, site: Path) -> tuple[bool, str]:
    """`mkdocs build --strict` of the site at `root`: whether it passed with no warning, and its output.
    Not --quiet: it hides the warnings that strict mode counts."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    return done.returncode == 0 and "WARNING" not in output, output


def test_site_builds_strictly(tmp_path):
    passed, output = _strict_build(ROOT, tmp_path)
    assert passed, f"mkdocs build --strict failed (install `.[test]`):\n{output}"
    assert (tmp_path / "api" / "index.html").exists()


def test_a_broken_cross_reference_fails_the_strict_build(tmp_path):
    """The check above can fail: a copy of the docs with one reference that resolves nowhere (as
    `[+hide][+next]` did before the command reference escaped brackets) does not build."""
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", "site", ".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "tuning.md"
    page.write_text(page.read_text() + "\nRuns named [+hide][+next].\n")
    passed, output = _strict_build(tmp_path, tmp_path / "site")
    assert not passed and "+next" in output, output


def test_the_commands_page_lists_every_command():
    from cli.commands import COMMANDS

    listed = re.findall(r"^\| `prescient ([a-z-]+)", (ROOT / "docs" / "commands.md").read_text(), flags=re.M)
    assert set(listed) == set(COMMANDS), f"docs/commands.md lacks {sorted(set(COMMANDS) - set(listed))}"


def test_readme_is_short_keeps_its_commands_and_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    head = "\n".join(text.splitlines()[:20])
    assert "pip install -e . && prescient demo --out runs/demo" in head
    assert 'pip install -e ".[test]" && python -m pytest -q' in head
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
