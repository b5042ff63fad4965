"""Corpora: deterministic, disjoint, covering splits; prose in stdlib-docs; local files."""

from __future__ import annotations

import json
import re

import pytest

from prescient.errors import DatasetError
from training.corpora import SPLITS, _stdlib_rows, docs_of, load_corpus, split_of, stdlib_files, stdlib_root

CODE_LINE = re.compile(r"(def |class |import |from \S+ import |return\b)")


def code_line_fraction(texts: list[str]) -> float:
    lines = [line.lstrip() for text in texts for line in text.splitlines() if line.strip()]
    return sum(bool(CODE_LINE.match(line)) for line in lines) / len(lines)


def test_split_of_is_pinned():
    """The rule is a hash of the key's bytes (Python's hash() would change per process); pinned
    here so that splits, and the traces made from them, stay the same across versions."""
    golden = {"validation": [7, 29], "test": [6, 16]}
    assert {s: [i for i in range(40) if split_of(f"row-{i}") == s] for s in golden} == golden
    assert (split_of("json/decoder.py"), split_of("asyncio/tasks.py")) == ("train", "validation")
    counts = [split_of(f"row-{i}") for i in range(2000)]
    assert {s: round(counts.count(s) / 2000, 2) for s in SPLITS} == pytest.approx(
        {"train": 0.90, "validation": 0.05, "test": 0.05}, abs=0.02)


@pytest.fixture(scope="module")
def code_splits() -> dict:
    return {split: load_corpus("stdlib-code", split) for split in SPLITS}


def test_stdlib_code_splits_are_disjoint_covering_and_deterministic(code_splits):
    paths = {split: code_splits[split]["path"] for split in SPLITS}
    for split, found in paths.items():
        assert len(set(found)) == len(found) and all(split_of(p) == split for p in found)
    covered = {p for found in paths.values() for p in found}
    assert sum(len(found) for found in paths.values()) == len(covered)  # no file in two splits
    every = {str(f.relative_to(stdlib_root())) for f in stdlib_files()}
    assert covered <= every and len(covered) > 0.95 * len(every)  # only unreadable or blank files are left out
    assert not any("site-packages" in p for p in every)
    regenerated = list(_stdlib_rows("stdlib-code", "validation", str(stdlib_root())))
    assert [r["path"] for r in regenerated] == paths["validation"]  # the cached split is what a rebuild gives
    row = code_splits["validation"][0]
    assert row["text"] == (stdlib_root() / row["path"]).read_text(encoding="utf-8")


def test_stdlib_docs_are_prose_from_the_same_files(code_splits):
    docs = load_corpus("stdlib-docs", "validation")
    assert set(docs["path"]) <= set(code_splits["validation"]["path"])
    assert len(docs) > 0.8 * len(code_splits["validation"])
    lines = [(row["path"], line) for row in docs for line in row["text"].splitlines() if line.strip()]
    sources = {path: (stdlib_root() / path).read_text(encoding="utf-8") for path in set(docs["path"])}
    verbatim = sum(line in sources[path] for path, line in lines)
    assert verbatim > 0.99 * len(lines)  # extracted from the file (escapes in docstrings aside)
    assert code_line_fraction(docs["text"]) < 0.01 < 0.05 < code_line_fraction(code_splits["validation"]["text"])


def test_docs_of_keeps_docstrings_and_whole_line_comments_in_order():
    source = '''#!/usr/bin/env python
"""Module doc."""
import os  # trailing comment, left out

# A comment line.
def f():
    """Function doc,
    two lines."""
    text = """
    # not a comment: inside a string
    """
    #   indented comment
    return text
'''
    assert docs_of(source) == "Module doc.\nA comment line.\nFunction doc,\ntwo lines.\nindented comment"
    assert docs_of("def broken(:\n") == ""


def write_rows(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_local_json_is_split_by_row_with_the_text_field(tmp_path):
    rows = [{"id": i, "body": f"document number {i}", "text": "decoy"} for i in range(200)]
    spec = "json:" + write_rows(tmp_path / "docs.jsonl", rows)
    splits = {split: load_corpus(spec, split, text_field="body") for split in SPLITS}
    ids = {split: data["id"] for split, data in splits.items()}
    assert sorted(i for found in ids.values() for i in found) == list(range(200))  # disjoint and covering
    for split, found in ids.items():
        assert found and all(split_of(f"row-{i}") == split for i in found)
        assert splits[split]["text"] == [f"document number {i}" for i in found]  # the field asked for
    assert load_corpus(spec, "validation", text_field="body")["id"] == ids["validation"]  # deterministic
    assert load_corpus(str(tmp_path / "docs.jsonl"), "test", text_field="body")["id"] == ids["test"]  # bare path


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("[]", "cannot read dataset file"),
    ('{"text": "only row"}\n', "split 'validation' has no rows"),
    ('{"body": "a"}\n{"body": "b"}\n', "no text field 'text'; its columns are \\['body'\\]"),
    ('{"text": 1}\n{"text": 2}\n', "holds .*int64.*not text"),
])
def test_unusable_local_datasets_raise_dataset_error(tmp_path, content, message):
    path = tmp_path / "data.json"
    path.write_text(content)
    split = "validation" if "no rows" in message else "train"
    assert split_of("row-0") == "train"  # so a one-row file has no validation rows
    with pytest.raises(DatasetError, match=message):
        load_corpus(f"json:{path}", split)


def test_unknown_split_and_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="unknown split 'dev'"):
        load_corpus("stdlib-code", "dev")
    with pytest.raises(DatasetError, match="does not exist"):
        load_corpus(f"json:{tmp_path / 'nope.json'}", "train")
