"""Text corpora: the two built-in ones and any `datasets` spec.

Built-in corpora exist on every machine with Python:
  stdlib-code  the running interpreter's standard-library source files
  stdlib-docs  their docstrings and comments (English prose)
Both are split by file into train / validation / test with a hash of the file's path,
so the split is deterministic and no file lands in two splits.

Any other spec goes through `datasets.load_dataset`:
  json:PATH / jsonl:PATH / text:PATH / parquet:PATH / csv:PATH   a local file
  PATH with one of those extensions                               the same
  NAME (or NAME:CONFIG)                                           a hub dataset
A local file is split by row number with the same hash rule: `datasets` names a single
file's rows "train", and taking those as the train split would overlap the others.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import datasets

from prescient.errors import DatasetError

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
BUILTIN = ("stdlib-code", "stdlib-docs")
_LOCAL_BUILDERS = {"json": "json", "jsonl": "json", "text": "text", "txt": "text", "parquet": "parquet", "csv": "csv"}
_SPLIT_PERCENT = (90, 5)  # train, validation; the rest is test
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def split_of(key: str) -> str:
    """Deterministic split of an item (a file path or a row number) by hash."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 100
    if bucket < _SPLIT_PERCENT[0]:
        return "train"
    if bucket < sum(_SPLIT_PERCENT):
        return "validation"
    return "test"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Standard-library source files, sorted, without installed third-party packages."""
    files: list[Path] = []
    # os.walk, pruned: site-packages lives under the stdlib folder and can hold 100k files.
    for folder, subfolders, names in os.walk(stdlib_root()):
        subfolders[:] = [d for d in subfolders if d not in _NOT_STDLIB]
        files += [Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(files)


def _read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def docs_of(source: str) -> str:
    """Docstrings and whole-line comments of one Python source file, in file order.

    Comments are found by a line pattern rather than `tokenize` (ten times slower over the
    standard library); lines inside string literals are excluded with the AST's spans.
    Trailing comments after code are left out.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    pieces: list[tuple[int, str]] = []
    in_string: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and node.body:
                pieces.append((node.body[0].lineno, doc))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.end_lineno:
            in_string.update(range(node.lineno, node.end_lineno + 1))
    for line, raw in enumerate(source.splitlines(), start=1):
        stripped = raw.lstrip()
        if stripped.startswith("#") and line not in in_string:
            text = stripped[1:].strip()
            if text and not text.startswith("!"):
                pieces.append((line, text))
    return "\n".join(text for _, text in sorted(pieces, key=lambda p: p[0]))


def _stdlib_rows(kind: str, split: str, root: str) -> Iterator[dict]:
    # `root` is an argument so that the datasets cache keys on the interpreter it read.
    for path in stdlib_files():
        rel = str(path.relative_to(stdlib_root()))
        if split_of(rel) != split:
            continue
        source = _read_source(path)
        if source is None:
            continue
        text = source if kind == "stdlib-code" else docs_of(source)
        if text.strip():
            yield {"text": text, "path": rel}


@lru_cache(maxsize=16)
def _builtin(kind: str, split: str) -> datasets.Dataset:
    # from_generator caches the Arrow table in the datasets cache, keyed by the generator
    # and its arguments: the docstring extraction (about 20 s) runs once per machine.
    return datasets.Dataset.from_generator(
        _stdlib_rows,
        gen_kwargs={"kind": kind, "split": split, "root": str(stdlib_root())},
        features=datasets.Features({"text": datasets.Value("string"), "path": datasets.Value("string")}),
    )


def _parse_local(spec: str) -> tuple[str, str] | None:
    """(builder, path) when `spec` names a local file, else None."""
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in _LOCAL_BUILDERS:
        return _LOCAL_BUILDERS[prefix], rest
    suffix = Path(spec).suffix.lstrip(".")
    if suffix in _LOCAL_BUILDERS and Path(spec).exists():
        return _LOCAL_BUILDERS[suffix], spec
    return None


def _local_split(builder: str, path: str, split: str) -> datasets.Dataset:
    """Rows of one local file whose row number hashes to `split` (a single file holds no splits)."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"dataset file {file} does not exist")
    if file.stat().st_size == 0:
        raise DatasetError(f"dataset file {file} is empty")
    try:
        whole = datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as exc:  # datasets raises many kinds (ValueError, StopIteration, Arrow errors...)
        raise DatasetError(f"cannot read dataset file {file} as {builder} ({type(exc).__name__}: {exc})") from exc
    return whole.select([i for i in range(len(whole)) if split_of(f"row-{i}") == split])


def load_corpus(spec: str, split: str = "train", text_field: str = "text") -> datasets.Dataset:
    """Rows of `spec`'s split, each with a `text` column. Raises DatasetError when unusable."""
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if spec in BUILTIN:
        data = _builtin(spec, split)
    elif (local := _parse_local(spec)) is not None:
        data = _local_split(*local, split)
    else:
        name, _, config = spec.partition(":")
        try:
            data = datasets.load_dataset(name, config or None, split=split)
        except Exception as exc:  # the hub raises many kinds; all mean "cannot load this spec"
            raise DatasetError(
                f"cannot load dataset {spec!r} (split {split!r}): {exc}. Built-in corpora: {', '.join(BUILTIN)}; "
                "local files: json:PATH, text:PATH, parquet:PATH, csv:PATH"
            ) from exc
    if len(data) == 0:
        raise DatasetError(f"dataset {spec!r} split {split!r} has no rows")
    if text_field not in data.column_names:
        raise DatasetError(
            f"dataset {spec!r} has no text field {text_field!r}; its columns are {data.column_names}. "
            "Pass --text-field NAME."
        )
    if data.features[text_field] not in (datasets.Value("string"), datasets.Value("large_string")):
        raise DatasetError(f"field {text_field!r} of dataset {spec!r} holds {data.features[text_field]}, not text")
    if text_field != "text":
        data = data.remove_columns([c for c in ("text",) if c in data.column_names])
        data = data.rename_column(text_field, "text")
    return data
