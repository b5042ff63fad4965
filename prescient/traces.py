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

and, in a trace made with `prescient trace --hidden-states` (the manifest's `hidden_states` says so),

    hidden      bfloat16[N, L, H] each MoE layer's block input (after the post-attention norm):
                what the layer's router reads, and what `predictor.probe` learns from

L runs over the MoE layers in forward order (an encoder-decoder's encoder layers first, then
its decoder's; see `training.tracing` for what a decoder layer's entry of a row means), and
T = min(top_t, E).

A shard is written to a temporary file and renamed, and only then listed in the manifest
with its SHA-256, so a shard named in the manifest is always complete. `complete` turns true at
the end. A writer opened on an interrupted trace removes the temporaries a killed write left
behind and continues the shard numbering after the last listed shard.

`load_trace` reads the hidden column only when asked (`hidden=True`; `require_hidden_states`
refuses a trace without it). It checks what it reads (`check_shard`): the SHA-256 (traces written before it was
recorded go without), each column's shape and dtype against the manifest, ids in range and
finite logits; an error names the shard and the column, so damage never reaches the compiled
cache or a result.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from prescient.atomic import write_atomic, write_errors, write_json_atomic
from prescient.errors import TraceError
from prescient.fingerprint import ModelFingerprint

FORMAT = "prescient-trace/1"
MANIFEST = "manifest.json"
COLUMNS = ("seq_id", "position", "token_id", "topk_ids", "topt_ids", "topt_logits")
HIDDEN = "hidden"  # the optional column of block inputs
HIDDEN_DTYPE = torch.bfloat16


@dataclass
class TraceManifest:
    fingerprint: ModelFingerprint
    dataset: str
    split: str
    top_t: int
    settings: dict = field(default_factory=dict)  # what else decides the rows: seq_len, max_tokens...
    shards: list[dict] = field(default_factory=list)  # {"file", "rows", "sequences"}
    complete: bool = False
    hidden_size: int | None = None  # H of the `hidden` column; None: the trace holds no hidden states

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS + ((HIDDEN,) if self.hidden_size else ())

    @property
    def n_tokens(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def to_dict(self) -> dict:
        hidden = {"hidden_states": {"column": HIDDEN, "dtype": "bfloat16", "size": self.hidden_size}}
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
            **(hidden if self.hidden_size else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TraceManifest":
        """Raises TraceError for another format; KeyError, TypeError or ValueError for a field
        that is missing or wrong."""
        if data.get("format") != FORMAT:
            raise TraceError(f"unknown trace format {data.get('format')!r}; expected {FORMAT!r}")
        manifest = cls(
            fingerprint=ModelFingerprint.from_dict(data["fingerprint"]),
            dataset=data["dataset"],
            split=data["split"],
            top_t=data["top_t"],
            settings=data.get("settings", {}),
            shards=list(data["shards"]),
            complete=data["complete"],
            hidden_size=data["hidden_states"]["size"] if "hidden_states" in data else None,
        )
        manifest._check()
        return manifest

    def _check(self) -> None:
        if type(self.top_t) is not int or not 1 <= self.top_t <= self.fingerprint.n_experts:
            raise ValueError(f"top_t {self.top_t!r} is not in 1..{self.fingerprint.n_experts} (the experts per layer)")
        if self.hidden_size is not None and (type(self.hidden_size) is not int or self.hidden_size < 1):
            raise ValueError(f"hidden_states size {self.hidden_size!r} is not a positive whole number")
        if not isinstance(self.complete, bool) or not isinstance(self.settings, dict):
            raise TypeError("complete must be true or false, settings an object")
        for shard in self.shards:
            name, rows, sequences = shard["file"], shard["rows"], shard["sequences"]
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise ValueError(f"shard file {name!r} is not a shard name in the trace folder")
            if type(rows) is not int or type(sequences) is not int or rows < 0 or sequences < 0:
                raise ValueError(f"shard {name}: rows {rows!r} and sequences {sequences!r} must be whole numbers")


def read_manifest(trace_dir: str | Path) -> TraceManifest | None:
    """The manifest of `trace_dir`, or None when the folder has none yet."""
    path = Path(trace_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return TraceManifest.from_dict(json.loads(path.read_text()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
            TraceError) as exc:  # TraceError: a damaged "format" field; name the file either way
        raise TraceError(f"{path} is not a valid trace manifest ({type(exc).__name__}: {exc}); delete the folder "
                         "and trace again") from exc


class TraceWriter:
    """Appends shards to a trace directory; each shard lands atomically."""

    def __init__(self, trace_dir: str | Path, manifest: TraceManifest):
        self.dir = Path(trace_dir)
        with write_errors(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob(".*.tmp"):  # temporaries of a killed write; never listed
            leftover.unlink()
        self.manifest = manifest
        self._save_manifest()

    def _save_manifest(self) -> None:
        write_json_atomic(self.dir / MANIFEST, self.manifest.to_dict())

    def add_shard(self, columns: dict[str, torch.Tensor], sequences: int) -> None:
        missing = set(self.manifest.columns) - set(columns)
        if missing:
            raise ValueError(f"shard lacks columns {sorted(missing)}")
        name = f"shard-{len(self.manifest.shards):05d}.safetensors"
        tensors = {k: columns[k].contiguous() for k in self.manifest.columns}
        data = save(tensors)
        write_atomic(self.dir / name, lambda p: p.write_bytes(data))
        self.manifest.shards.append({"file": name, "rows": int(columns["token_id"].shape[0]), "sequences": sequences,
                                     "sha256": _sha256(data)})
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


class MissingHiddenStatesError(TraceError):
    """A trace without the hidden column was given to what learns from hidden states."""


def require_hidden_states(trace_dir: str | Path, manifest: TraceManifest) -> None:
    """Refuse a trace made without `--hidden-states`, saying how to make one."""
    if not manifest.hidden_size:
        raise MissingHiddenStatesError(
            f"trace {trace_dir} holds no hidden states; trace it again with `prescient trace ... --hidden-states` "
            "(a hidden-state probe learns from each MoE layer's input)")


def load_trace(trace_dir: str | Path, require_complete: bool = True, hidden: bool = False) -> Trace:
    """Load every shard of a trace directory; clear errors for missing or corrupt ones.
    `hidden`: load the `hidden` column too (refused, naming the flag, if the trace has none)."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise TraceError(f"trace directory {trace_dir} does not exist; make one with `prescient trace`")
    manifest = read_manifest(trace_dir)
    if manifest is None:
        raise TraceError(f"{trace_dir} has no {MANIFEST}; it is not a trace directory (make one with `prescient trace`)")
    if require_complete and not manifest.complete:
        raise TraceError(f"trace {trace_dir} is incomplete (interrupted?); run the same `prescient trace` again to resume")
    if not manifest.shards:
        raise TraceError(f"trace {trace_dir} holds no tokens")
    if hidden:
        require_hidden_states(trace_dir, manifest)
    wanted = manifest.columns if hidden else COLUMNS
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in wanted}
    for shard in manifest.shards:
        data = read_shard(trace_dir, shard, manifest)
        for k in wanted:
            parts[k].append(data[k])
    return Trace(manifest, {k: torch.cat(v) for k, v in parts.items()})


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_shard(trace_dir: Path, shard: dict, manifest: TraceManifest) -> dict[str, torch.Tensor]:
    """One listed shard's columns, checked (see `check_shard`)."""
    path = trace_dir / shard["file"]
    redo = f"delete {trace_dir} and trace again"
    try:
        raw = path.read_bytes()
        if "sha256" in shard and shard["sha256"] != _sha256(raw):
            raise TraceError(f"trace shard {path} is missing or corrupt (its SHA-256 differs from the manifest's); "
                             f"{redo}")
        data = load(raw)
    except (SafetensorError, OSError) as exc:
        raise TraceError(f"trace shard {path} is missing or corrupt ({exc}); {redo}") from exc
    check_shard(path, data, manifest, shard["rows"], redo)
    return data


def check_shard(path: Path, data: dict[str, torch.Tensor], manifest: TraceManifest, rows: int, redo: str) -> None:
    """Raise TraceError naming the shard and column unless `data` holds every column with the
    manifest's shapes, integer ids in range and finite logits."""
    fp = manifest.fingerprint
    if set(data) != set(manifest.columns):
        raise TraceError(f"trace shard {path} holds columns {sorted(data)}, expected {list(manifest.columns)}; "
                         f"{redo}")
    per_layer = (rows, fp.n_moe_layers)
    shapes = {"seq_id": (rows,), "position": (rows,), "token_id": (rows,), "topk_ids": (*per_layer, fp.top_k),
              "topt_ids": (*per_layer, manifest.top_t), "topt_logits": (*per_layer, manifest.top_t)}
    if manifest.hidden_size:
        shapes[HIDDEN] = (*per_layer, manifest.hidden_size)
    floats = ("topt_logits", HIDDEN)
    for column, shape in shapes.items():
        tensor = data[column]
        if tuple(tensor.shape) != shape:
            raise TraceError(f"trace shard {path}: column {column} has shape {list(tensor.shape)}, the manifest "
                             f"says {list(shape)}; {redo}")
        if tensor.is_floating_point() != (column in floats) or tensor.dtype == torch.bool:
            raise TraceError(f"trace shard {path}: column {column} has dtype {tensor.dtype}; {redo}")
    for column, what in (("topt_logits", "router logits"), (HIDDEN, "hidden states")):
        if column in shapes and not torch.isfinite(data[column]).all():
            bad = (~torch.isfinite(data[column])).nonzero()
            raise TraceError(f"trace shard {path}: column {column} holds {data[column][tuple(bad[0])].item()} "
                             f"at index {bad[0].tolist()}; {what} must be finite; {redo}")
    experts = (0, fp.n_experts, "expert id", f" (the model has {fp.n_experts} experts)")
    limits = {"seq_id": (0, None, "sequence id", ""), "position": (0, None, "position", ""),
              "token_id": (0, fp.vocab_size, "token id", f" (the vocabulary has {fp.vocab_size} tokens)"),
              "topk_ids": experts, "topt_ids": experts}
    for column, (low, high, what, why) in limits.items():
        tensor = data[column]
        if not len(tensor.view(-1)):
            continue
        least, most = torch.aminmax(tensor)
        if least < low or (high is not None and most >= high):
            outside = (tensor < low) | (tensor >= high) if high is not None else tensor < low
            where = outside.nonzero()[0]
            allowed = f"{low}..{high - 1}" if high is not None else f">= {low}"
            raise TraceError(f"trace shard {path}: column {column} holds {what} {tensor[tuple(where)].item()} at index "
                             f"{where.tolist()}, outside {allowed}{why}; {redo}")
