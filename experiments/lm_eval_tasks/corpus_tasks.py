"""The rows of the lm-evaluation-harness tasks in this folder (`custom_dataset` in their YAML),
built from the built-in corpora's validation split; the same rows on every machine."""

from __future__ import annotations

import re

import datasets

from training.corpora import load_corpus

CONTEXT_WORDS, TARGET_WORDS = 16, 1  # a docstring paragraph's words: given, then scored (the next word, as LAMBADA)
ROWS = 64  # per task; `lm_eval --limit N` takes the first N


def docstring_rows(**_metadata) -> datasets.DatasetDict:
    """{context, target}: a paragraph's first CONTEXT_WORDS words, then its next TARGET_WORDS."""
    rows = []
    for text in load_corpus("stdlib-docs", "validation")["text"]:
        for paragraph in re.split(r"\n\s*\n", text):
            words = paragraph.split()
            if len(words) >= CONTEXT_WORDS + TARGET_WORDS and len(rows) < ROWS:
                rows.append({"context": " ".join(words[:CONTEXT_WORDS]),
                             "target": " " + " ".join(words[CONTEXT_WORDS:CONTEXT_WORDS + TARGET_WORDS])})
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


def code_rows(**_metadata) -> datasets.DatasetDict:
    """{prompt, target}: a function's `def` line (with its newline), then its body up to the first
    blank line."""
    rows = []
    for text in load_corpus("stdlib-code", "validation")["text"]:
        for match in re.finditer(r"^[ \t]*def [^\n]*:\n((?:[^\n]*\S[^\n]*\n)+)", text, flags=re.M):
            if len(rows) < ROWS:
                body = match.group(1)
                rows.append({"prompt": match.group(0)[: -len(body)], "target": body.rstrip("\n")})
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})
