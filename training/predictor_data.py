"""LightningDataModule over router traces: fixed-length windows of token ids with the
router's choices for every MoE layer as targets.

A traced sequence is cut into consecutive windows of `window` tokens (the last one shorter,
padded, with `mask` False on the padding). Each window is one sample:

    token_ids   [W]        long
    mask        [W]        bool, True on real tokens
    topk_ids    [W, L, k]  long, the router's selection, best first
    topt_ids    [W, L, T]  long, the T highest-logit experts
    topt_logits [W, L, T]  float32, their logits

and, with `horizon` H > 0 (targets of the forecast heads, linked from --model.horizon by the CLI):

    future_topk_ids [W, H, L, k]  long, the router's selection for token t+h (h = 1..H), read
                                  from the same sequence, past the window's end too
    future_mask     [W, H]        bool, True where token t is real and token t+h exists in its
                                  sequence (never a target beyond the sequence's end)

Validation reads `val_trace_dir` when given, otherwise a deterministic `val_fraction` of the
training trace's sequences (chosen by seq_id with a seeded permutation), so the same
sequences are held out on every run and every DDP rank.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from predictor.base import describe_trace
from prescient.errors import PrescientError, TraceError
from prescient.traces import Trace, load_trace

log = logging.getLogger(__name__)


class TraceWindows(Dataset):
    """Windows over the given sequences (lists of contiguous row indices) of a trace."""

    def __init__(self, trace: Trace, sequences: list[torch.Tensor], window: int, horizon: int = 0):
        self.trace, self.window, self.horizon = trace, window, horizon
        self.spans = [
            (int(rows[0]) + offset, min(window, len(rows) - offset))
            for rows in sequences
            for offset in range(0, len(rows), window)
        ]
        self.sequence_ends = [int(rows[-1]) + 1 for rows in sequences for _ in range(0, len(rows), window)]

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, n = self.spans[index]
        pad = self.window - n
        rows = slice(start, start + n)

        def take(column: str, dtype: torch.dtype) -> torch.Tensor:
            value = self.trace[column][rows].to(dtype)
            return F.pad(value, (0, 0) * (value.dim() - 1) + (0, pad))

        sample = {
            "token_ids": take("token_id", torch.long),
            "mask": torch.arange(self.window) < n,
            "topk_ids": take("topk_ids", torch.long),
            "topt_ids": take("topt_ids", torch.long),
            "topt_logits": take("topt_logits", torch.float32),
        }
        if self.horizon:
            sample.update(self._future(start, n, self.sequence_ends[index]))
        return sample

    def _future(self, start: int, n: int, end: int) -> dict[str, torch.Tensor]:
        """Forecast targets of the window's tokens: rows t+1..t+H, masked past the sequence end."""
        target_rows = start + torch.arange(self.window)[:, None] + torch.arange(1, self.horizon + 1)  # [W, H]
        mask = (torch.arange(self.window) < n)[:, None] & (target_rows < end)
        topk = self.trace["topk_ids"][target_rows.clamp(max=end - 1)].long()  # [W, H, L, k]
        return {"future_topk_ids": topk, "future_mask": mask}


def split_sequences(trace: Trace, val_fraction: float, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(train, validation) sequences: a seeded permutation of the sequences, the first
    ⌈val_fraction·n⌉ for validation."""
    sequences = trace.sequences()
    if len(sequences) < 2:
        raise TraceError(
            f"the trace holds {len(sequences)} sequence(s); a validation split needs at least 2 "
            "(trace more tokens or give data.val_trace_dir)"
        )
    # order by seq_id first, so the split depends on which sequences exist, not on shard order
    sequences.sort(key=lambda rows: int(trace["seq_id"][rows[0]]))
    n_val = min(len(sequences) - 1, max(1, round(val_fraction * len(sequences))))
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed)).tolist()
    return [sequences[i] for i in order[n_val:]], [sequences[i] for i in order[:n_val]]


class DataSettingsError(PrescientError):
    """A data module setting is out of its range."""


def _check_settings(val_fraction: float | None, window: int, batch_size: int, num_workers: int, horizon: int) -> None:
    """Refuse settings the DataLoader would fail on only once training starts (`val_fraction`
    None: a validation trace is given instead)."""
    least = {"window": (window, 1), "batch_size": (batch_size, 1), "num_workers": (num_workers, 0),
             "horizon": (horizon, 0)}
    for name, (value, low) in least.items():
        if value < low:
            raise DataSettingsError(f"--data.{name} is {value}; it must be at least {low}")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise DataSettingsError(f"--data.val_fraction is {val_fraction}; it must lie between 0 and 1")


class PredictorDataModule(L.LightningDataModule):
    def __init__(
        self,
        trace_dir: str,
        val_trace_dir: str | None = None,
        val_fraction: float = 0.1,
        window: int = 128,
        batch_size: int = 64,
        num_workers: int = 0,
        split_seed: int = 0,
        horizon: int = 0,
    ):
        """
        Args:
            trace_dir: router trace to train on (made by `prescient trace`).
            val_trace_dir: router trace to validate on; default: hold out `val_fraction` of `trace_dir`.
            val_fraction: share of the training trace's sequences held out when `val_trace_dir` is not given.
            window: tokens per training sample; longer sequences are cut into consecutive windows.
            batch_size: windows per batch (SiDA: 64).
            num_workers: DataLoader worker processes.
            split_seed: seed of the held-out split.
            horizon: forecast targets for tokens t+1..t+horizon (the CLI links it from --model.horizon).
        """
        super().__init__()
        _check_settings(val_fraction=None if val_trace_dir else val_fraction, window=window, batch_size=batch_size,
                        num_workers=num_workers, horizon=horizon)
        self.save_hyperparameters()
        self.train_set: TraceWindows | None = None
        self.val_set: TraceWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        train = load_trace(hp.trace_dir)
        if hp.val_trace_dir:
            val = load_trace(hp.val_trace_dir)
            train.fingerprint.require_same(val.fingerprint, f"validation trace {hp.val_trace_dir}")
            train_seqs, val_seqs = train.sequences(), val.sequences()
        else:
            val = train
            train_seqs, val_seqs = split_sequences(train, hp.val_fraction, hp.split_seed)
        self.train_set = TraceWindows(train, train_seqs, hp.window, hp.horizon)
        self.val_set = TraceWindows(val, val_seqs, hp.window, hp.horizon)
        log.info("predictor data: %d training and %d validation windows of %d tokens",
                 len(self.train_set), len(self.val_set), hp.window)

    def describe(self) -> dict:
        """What a predictor artifact records about its training data."""
        hp = self.hparams
        train = describe_trace(self.train_set.trace.manifest, hp.trace_dir)
        if hp.val_trace_dir:
            val = {"val_trace_dir": hp.val_trace_dir}
        else:
            val = {"val_fraction": hp.val_fraction, "split_seed": hp.split_seed}
        return {**train, **val, "window": hp.window}

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        hp = self.hparams
        return DataLoader(dataset, batch_size=hp.batch_size, shuffle=shuffle, num_workers=hp.num_workers,
                          persistent_workers=hp.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
