"""The command reference (`docs/reference/commands.md`, rendered by `cli/reference.py`
from `prescient`'s argument parser): every flag of every command is on the committed page, and the
page is what the parser renders to (`prescient report` rewrites it)."""

from __future__ import annotations

import argparse

from cli.reference import PAGE, build, commands, flags, names, render, render_commands


def test_every_flag_of_every_command_is_on_the_page():
    text = PAGE.read_text()
    parser, _ = build()
    missing = []
    for name, _summary, sub in commands(parser):
        if f"## `prescient {name}`" not in text:
            missing.append(name)
            continue
        section = text.split(f"## `prescient {name}`", 1)[1].split("\n## ", 1)[0]
        missing += [f"{name} {flag}" for _group, action in flags(sub) for flag in names(action)
                    if f"`{flag}`" not in section]
    assert not missing, (f"{PAGE.name} lacks {missing}: run `prescient report` and commit "
                         "docs/reference/commands.md")


def test_the_page_is_what_the_parser_renders_to():
    assert PAGE.read_text() == render(), "run `prescient report` and commit docs/reference/commands.md"


def test_the_report_step_renders_and_checks_the_page(capsys):
    from cli.main import main

    assert render_commands() == {PAGE: render()}
    main(["report", "--check"])  # exits 1 when any generated page is stale, this one included
    assert "differs" not in capsys.readouterr().err


def test_a_new_flag_is_caught():
    """The walk is generic: a flag added to any command shows up in its section, with its group,
    default and help, and a page rendered before it lacks it."""
    parser, _ = build()
    sub = dict((name, p) for name, _, p in commands(parser))["generate"]
    group = sub.add_argument_group("memory")
    group.add_argument("--a-new-flag", default=7, help="a flag added after the page was rendered")
    rows = [(g, a) for g, a in flags(sub) if "--a-new-flag" in a.option_strings]
    assert rows and rows[0][0] == "memory" and isinstance(rows[0][1], argparse.Action)
    assert "`--a-new-flag`" not in PAGE.read_text()


def test_no_environment_default_reaches_the_page(monkeypatch):
    monkeypatch.setenv("PRESCIENT_API_KEY", "sk-secret-key-on-the-page")
    assert "sk-secret-key-on-the-page" not in render()
