"""Router-trace directories: a JSON manifest plus safetensors column shards.

Layout of a trace directory:

    manifest.json          format, fingerprint, dataset spec, split, top_t, shards, complete
    shard-00000.safetensors
    shard-00001.safetensors ...

Each shard holds one row per real token (padding never appears), with columns

    seq_id      int64  [N]        sequence (window) index in the split, in tracing order
    position    int32  [N]        position of the token in its sequence
    token_id    int64  [N]        the token
    topk_ids    int16  [N, L, k]  experts the router selected, best first, per MoE layer
    topt_ids    int16  [N, L, T]  the T highest-logit experts, best first
    topt_logits float32[N, L, T]  their router logits

L runs over the MoE layers in forward order (an encoder-decoder's encoder layers first, then
its decoder's; see `training.tracing` for what a decoder layer's entry of a row means), and
T = min(top_t, E).

A shard is written to a temporary file and renamed, and only then listed in the manifest,
so a shard named in the manifest is always complete. `complete` turns true at the end.
A writer opened on an interrupted trace removes the temporaries a killed write left behind
and continues the shard numbering after the last listed shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from prescient.atomic import write_atomic, write_json_atomic
from prescient.errors import TraceError
from prescient.fingerprint import ModelFingerprint

FORMAT = "prescient-trace/1"
MANIFEST = "manifest.json"
COLUMNS = ("seq_id", "position", "token_id", "topk_ids", "topt_ids", "topt_logits")


@dataclass
class TraceManifest:
    fingerprint: ModelFingerprint
    dataset: str
    split: str
    top_t: int
    settings: dict = field(default_factory=dict)  # what else decides the rows: seq_len, max_tokens...
    shards: list[dict] = field(default_factory=list)  # {"file", "rows", "sequences"}
    complete: bool = False

    @property
    def n_tokens(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint.to_dict(),
            "dataset": self.dataset,
            "split": self.split,
            "top_t": self.top_t,
            "settings": self.settings,
            "n_tokens": self.n_tokens,
            "shards": self.shards,
            "complete": self.complete,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TraceManifest":
        if data.get("format") != FORMAT:
            raise TraceError(f"unknown trace format {data.get('format')!r}; expected {FORMAT!r}")
        return cls(
            fingerprint=ModelFingerprint.from_dict(data["fingerprint"]),
            dataset=data["dataset"],
            split=data["split"],
            top_t=int(data["top_t"]),
            settings=data.get("settings", {}),
            shards=list(data["shards"]),
            complete=bool(data["complete"]),
        )


def read_manifest(trace_dir: str | Path) -> TraceManifest | None:
    """The manifest of `trace_dir`, or None when the folder has none yet."""
    path = Path(trace_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return TraceManifest.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceError(f"{path} is not a valid trace manifest ({exc}); delete the folder and trace again") from exc


class TraceWriter:
    """Appends shards to a trace directory; each shard lands atomically."""

    def __init__(self, trace_dir: str | Path, manifest: TraceManifest):
        self.dir = Path(trace_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob(".*.tmp"):  # temporaries of a killed write; never listed
            leftover.unlink()
        self.manifest = manifest
        self._save_manifest()

    def _save_manifest(self) -> None:
        write_json_atomic(self.dir / MANIFEST, self.manifest.to_dict())

    def add_shard(self, columns: dict[str, torch.Tensor], sequences: int) -> None:
        missing = set(COLUMNS) - set(columns)
        if missing:
            raise ValueError(f"shard lacks columns {sorted(missing)}")
        name = f"shard-{len(self.manifest.shards):05d}.safetensors"
        tensors = {k: columns[k].contiguous() for k in COLUMNS}
        write_atomic(self.dir / name, lambda p: save_file(tensors, str(p)))
        self.manifest.shards.append({"file": name, "rows": int(columns["token_id"].shape[0]), "sequences": sequences})
        self._save_manifest()

    def finish(self) -> None:
        self.manifest.complete = True
        self._save_manifest()


@dataclass
class Trace:
    """A complete trace loaded into memory (columns concatenated over shards)."""

    manifest: TraceManifest
    columns: dict[str, torch.Tensor]

    @property
    def fingerprint(self) -> ModelFingerprint:
        return self.manifest.fingerprint

    def __len__(self) -> int:
        return int(self.columns["token_id"].shape[0])

    def __getitem__(self, column: str) -> torch.Tensor:
        return self.columns[column]

    def describe(self, trace_dir: str | Path) -> dict:
        """What a result JSON records about the trace it came from."""
        return {"dir": str(trace_dir), "dataset": self.manifest.dataset, "split": self.manifest.split,
                "n_tokens": len(self), "n_sequences": len(self.sequences()),
                "fingerprint": self.fingerprint.to_dict()}

    def sequences(self) -> list[torch.Tensor]:
        """Row indices of each sequence, in tracing order (rows of a sequence are contiguous)."""
        seq = self.columns["seq_id"]
        if len(seq) == 0:
            return []
        starts = torch.nonzero(torch.diff(seq) != 0).flatten() + 1
        bounds = [0, *starts.tolist(), len(seq)]
        return [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def load_trace(trace_dir: str | Path, require_complete: bool = True) -> Trace:
    """Load every shard of a trace directory; clear errors for missing or corrupt ones."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise TraceError(f"trace directory {trace_dir} does not exist; make one with `prescient trace`")
    manifest = read_manifest(trace_dir)
    if manifest is None:
        raise TraceError(f"{trace_dir} has no {MANIFEST}; it is not a trace directory (make one with `prescient trace`)")
    if require_complete and not manifest.complete:
        raise TraceError(f"trace {trace_dir} is incomplete (interrupted?); run the same `prescient trace` again to resume")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in COLUMNS}
    for shard in manifest.shards:
        path = trace_dir / shard["file"]
        try:
            data = load_file(str(path))
        except (FileNotFoundError, SafetensorError, OSError) as exc:
            raise TraceError(f"trace shard {path} is missing or corrupt ({exc}); delete {trace_dir} and trace again") from exc
        if set(data) != set(COLUMNS) or data["token_id"].shape[0] != shard["rows"]:
            raise TraceError(f"trace shard {path} does not match its manifest entry; delete {trace_dir} and trace again")
        for k in COLUMNS:
            parts[k].append(data[k])
    if not manifest.shards:
        raise TraceError(f"trace {trace_dir} holds no tokens")
    return Trace(manifest, {k: torch.cat(v) for k, v in parts.items()})
