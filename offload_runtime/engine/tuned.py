"""The configurations `prescient tune` measured best, kept per model and machine, and read back
as defaults by `engine.resolve.resolve_options` (`generate`, `serve`, `bench --memory`, the Python API).

A tuned file holds, per memory size measured, the settings that decode fastest there (transfer
workers, parallel reads, policy, cross-token prefetch, in-token lookahead, the expert pipeline, mapped experts,
whether to run the predictor at all). It is keyed by the
checkpoint (its config.json and its weight files' names and sizes: cheap to read on every start,
unlike the fingerprint, which hashes the weights) and this machine (its processor, cores and
memory): `$PRESCIENT_CACHE/tuned/` or `~/.cache/moe-prescient/tuned/`. A setting the user names
always wins; a model never tuned here runs the built-in defaults, and says in one line how to tune.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_results
from prescient.budget import MAX_BYTES
from prescient.errors import PrescientError
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)

TUNED_SETTINGS = ("transfer_workers", "read_depth", "policy", "next_token_min_chance", "lookahead_layers", "expert_pipeline",
                  "map_experts", "use_predictor")


def machine_key() -> str:
    """This machine as tuning sees it: processor model, cores and memory (not its host name, which a
    fresh machine of the same kind changes)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}|{os.cpu_count()}|{round(psutil.virtual_memory().total / 2**30)}"
    return f"{os.cpu_count()}cpu-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def checkpoint_key(model_dir: str | Path | ModelDirectory) -> str:
    """The checkpoint as tuning sees it: its config and its weight files' names and sizes."""
    directory = ModelDirectory.of(model_dir)
    files = sorted((file.name, file.stat().st_size) for file in directory.weight_files)
    text = json.dumps([directory.config_dict, files], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tuned_path(model_dir: str | Path | ModelDirectory) -> Path:
    """Where the tuned configurations of `model_dir` on this machine are kept."""
    root = Path(os.environ.get("PRESCIENT_CACHE", Path.home() / ".cache" / "moe-prescient"))
    return root / "tuned" / f"{checkpoint_key(model_dir)}-{machine_key()}.json"


@dataclass(frozen=True)
class Tuned:
    """Per memory size measured (bytes), the best settings (`TUNED_SETTINGS`)."""

    path: Path
    best: dict[int, dict[str, Any]]

    def settings_for(self, memory: int) -> dict[str, Any]:
        """The settings measured at the size nearest `memory` (by ratio)."""
        nearest = min(self.best, key=lambda size: abs(math.log(size / memory)))
        return dict(self.best[nearest])


def save_tuned(model_dir: str | Path | ModelDirectory, record: dict) -> Path:
    """Keep `record` (`tune`'s result, with "best": [{"memory": bytes, "settings": {...}}, ...])
    as this model's tuned file on this machine, beside the sizes an earlier tune kept that this one
    did not measure (a tune at 6 GiB keeps the one at 4 GiB); returns its path."""
    path = tuned_path(model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    measured = {entry["memory"] for entry in record["best"]}
    kept = [entry for entry in _entries(path) if entry["memory"] not in measured]
    write_results({**record, "best": sorted(kept + record["best"], key=lambda entry: entry["memory"])}, path)
    return path


class DamagedTunedFile(ValueError):
    """A tuned file that is not `save_tuned`'s schema; its message says what is wrong."""


def _entries(path: Path) -> list[dict]:
    """The sizes a tuned file keeps (none where it is missing, cannot be read or is damaged)."""
    try:
        return _read_entries(path)
    except (OSError, DamagedTunedFile):
        return []


def _read_entries(path: Path) -> list[dict]:
    """Each size a tuned file keeps, checked: {"memory": bytes, "settings": the `TUNED_SETTINGS` it
    names}; DamagedTunedFile saying what is wrong where it is not `save_tuned`'s schema."""
    try:
        data = json.loads(path.read_text(), parse_float=_finite_or_text)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise DamagedTunedFile(f"not JSON: {exc}") from None
    entries = data.get("best") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise DamagedTunedFile('it holds no list of measured sizes ("best")')
    return [_checked_entry(entry) for entry in entries]


def _checked_entry(entry: Any) -> dict:
    """One measured size, checked (see `_read_entries`)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict):
        raise DamagedTunedFile(f"entry {_short(entry)} is not a memory size with its settings")
    memory = entry.get("memory")
    whole = isinstance(memory, int) or (isinstance(memory, float) and math.isfinite(memory) and memory.is_integer())
    if isinstance(memory, bool) or not whole or not 1 <= memory <= MAX_BYTES:
        raise DamagedTunedFile(f"memory size {_short(memory)} is not a number of bytes in 1..2**60")
    settings = {k: v for k, v in entry["settings"].items() if k in TUNED_SETTINGS}
    try:
        RuntimeOptions(memory=int(memory), **settings)
    except PrescientError as exc:
        raise DamagedTunedFile(f"its settings at {int(memory)} bytes do not hold: {exc}") from None
    return {**entry, "memory": int(memory), "settings": settings}


def _finite_or_text(text: str) -> float | str:
    """A JSON number as a float, or as written where no float holds it (1e400): named so in errors."""
    value = float(text)
    return value if math.isfinite(value) else text


def _short(value: Any, most: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= most else f"{text[:most]}..."


def load_tuned(model_dir: str | Path | ModelDirectory) -> Tuned | None:
    """The tuned configurations of `model_dir` on this machine; None when never tuned here, or
    where the file cannot be read or is damaged (said in one line: which file, and why)."""
    path = tuned_path(model_dir)
    if not path.is_file():
        return None
    try:
        best = {entry["memory"]: entry["settings"] for entry in _read_entries(path)}
    except (OSError, DamagedTunedFile) as exc:
        log.warning("ignoring the tuned configuration %s (%s); running the built-in defaults (rerun `prescient "
                    "tune` to measure again)", path, " ".join(str(exc).split()))
        return None
    return Tuned(path, best) if best else None


def tuned_settings(model_dir: str | Path | ModelDirectory, memory: int) -> dict[str, Any]:
    """What `prescient tune` measured best for `model_dir` on this machine nearest `memory`, said in
    one line; {} (and how to tune, in one line) where it never ran."""
    tuned = load_tuned(model_dir)
    if tuned is None:
        log.info("configuration: the built-in defaults (to measure the fastest on this machine: prescient tune "
                 "--model %s [--predictor P], a few minutes)", model_dir)
        return {}
    settings = tuned.settings_for(memory)
    log.info("configuration: tuned on this machine (%s): %s", tuned.path,
             ", ".join(f"{k}={v}" for k, v in settings.items()))
    return settings

