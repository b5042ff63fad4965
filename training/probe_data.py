"""LightningDataModule over a hidden-state trace (`prescient trace --hidden-states`): one sample
per token, every MoE layer's block input with the router's choices as targets.

A batch of `batch_size` tokens is one dict:

    hidden      [B, L, H]  float32, each MoE layer's block input
    topk_ids    [B, L, k]  long, the router's selection, best first
    topt_ids    [B, L, T]  long, the T highest-logit experts
    topt_logits [B, L, T]  float32, their logits

Tokens are independent samples (the probe reads one token's hidden state), so batches are
gathered by index in one go (a `BatchSampler` as the sampler) rather than collated row by row.
Validation reads `val_trace_dir` when given, otherwise the same held-out sequences as the SiDA
data module (`predictor_data.split_sequences`).
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from predictor.base import describe_trace
from prescient.traces import HIDDEN, Trace, load_trace
from training.predictor_data import DataSettingsError, split_sequences

log = logging.getLogger(__name__)


class TraceTokens(Dataset):
    """The given rows of a hidden-state trace; indexed by a list of rows, it returns a batch."""

    def __init__(self, trace: Trace, rows: torch.Tensor):
        self.trace, self.rows = trace, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = self.rows[torch.as_tensor(indices)]
        return {
            "hidden": self.trace[HIDDEN][rows].float(),
            "topk_ids": self.trace["topk_ids"][rows].long(),
            "topt_ids": self.trace["topt_ids"][rows].long(),
            "topt_logits": self.trace["topt_logits"][rows].float(),
        }


class ProbeDataModule(L.LightningDataModule):
    def __init__(
        self,
        trace_dir: str,
        val_trace_dir: str | None = None,
        val_fraction: float = 0.1,
        batch_size: int = 512,
        num_workers: int = 0,
        split_seed: int = 0,
    ):
        """
        Args:
            trace_dir: hidden-state trace to train on (`prescient trace --hidden-states`).
            val_trace_dir: hidden-state trace to validate on; default: hold out `val_fraction` of `trace_dir`.
            val_fraction: share of the training trace's sequences held out when `val_trace_dir` is not given.
            batch_size: tokens per batch.
            num_workers: DataLoader worker processes.
            split_seed: seed of the held-out split.
        """
        super().__init__()
        if batch_size < 1 or num_workers < 0:
            bad, value, low = ("batch_size", batch_size, 1) if batch_size < 1 else ("num_workers", num_workers, 0)
            raise DataSettingsError(f"--data.{bad} is {value}; it must be at least {low}")
        if not val_trace_dir and not 0 < val_fraction < 1:
            raise DataSettingsError(f"--data.val_fraction is {val_fraction}; it must lie between 0 and 1")
        self.save_hyperparameters()
        self.train_set: TraceTokens | None = None
        self.val_set: TraceTokens | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        train = load_trace(hp.trace_dir, hidden=True)
        if hp.val_trace_dir:
            val = load_trace(hp.val_trace_dir, hidden=True)
            train.fingerprint.require_same(val.fingerprint, f"validation trace {hp.val_trace_dir}")
            train_rows, val_rows = torch.arange(len(train)), torch.arange(len(val))
        else:
            val = train
            train_seqs, val_seqs = split_sequences(train, hp.val_fraction, hp.split_seed)
            train_rows, val_rows = torch.cat(train_seqs), torch.cat(val_seqs)
        self.train_set, self.val_set = TraceTokens(train, train_rows), TraceTokens(val, val_rows)
        log.info("probe data: %d training and %d validation tokens", len(self.train_set), len(self.val_set))

    def describe(self) -> dict:
        """What a predictor artifact records about its training data."""
        hp = self.hparams
        train = describe_trace(self.train_set.trace.manifest, hp.trace_dir)
        if hp.val_trace_dir:
            return {**train, "val_trace_dir": hp.val_trace_dir}
        return {**train, "val_fraction": hp.val_fraction, "split_seed": hp.split_seed}

    def _loader(self, dataset: TraceTokens, shuffle: bool) -> DataLoader:
        hp = self.hparams
        order = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
        return DataLoader(dataset, sampler=BatchSampler(order, hp.batch_size, drop_last=False), batch_size=None,
                          num_workers=hp.num_workers, persistent_workers=hp.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
