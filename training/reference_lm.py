"""Lightning pieces that train the reference MoE: packed text windows and a causal-LM module."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from prescient.errors import DatasetError
from training.corpora import load_corpus

log = logging.getLogger(__name__)

CORPORA = ("stdlib-code", "stdlib-docs")


def pack_windows(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int) -> torch.Tensor:
    """Documents joined by EOS and cut into [n, seq_len] windows (the tail is dropped)."""
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def corpus_windows(tokenizer: PreTrainedTokenizerFast, dataset: str, split: str, text_field: str, seq_len: int,
                     count: int) -> torch.Tensor:
    """Up to `count` packed windows of `seq_len` tokens from the split's first documents."""
    texts, chars = [], 0
    for text in load_corpus(dataset, split, text_field)["text"]:
        texts.append(text)
        chars += len(text)
        if chars >= 8 * seq_len * count:  # comfortably more characters than the tokens asked for
            break
    windows = pack_windows(tokenizer, texts, seq_len)[:count]
    if len(windows) == 0:
        raise DatasetError(f"dataset {dataset!r} split {split!r} holds fewer than {seq_len} tokens")
    return windows


def corpus_texts(spec: str, split: str, max_chars: int) -> list[str]:
    """The first documents of a split, up to about `max_chars` characters."""
    texts, total = [], 0
    for text in load_corpus(spec, split)["text"]:
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


class SeededOrder(Sampler[int]):
    """A seeded shuffle, a new one each epoch, that can resume mid-epoch from its state."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.served = n, seed, 0, 0

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for index in order[self.served:]:
            self.served += 1
            yield index
        self.epoch, self.served = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.n


class ResumableLoader(DataLoader):
    """A DataLoader whose place in the epoch Lightning saves in checkpoints and restores on a
    resume, so a resumed build does not see the interrupted epoch's first batches twice."""

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "served": self.sampler.served}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch, self.sampler.served = state["epoch"], state["served"]


class PackedCorporaData(L.LightningDataModule):
    """Both built-in corpora, tokenized and packed; validation keeps each corpus apart."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, seq_len: int, batch_size: int,
                 corpus_chars: int, val_windows: int, seed: int):
        super().__init__()
        self.tokenizer, self.seq_len, self.batch_size = tokenizer, seq_len, batch_size
        self.corpus_chars, self.val_windows, self.seed = corpus_chars, val_windows, seed

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_windows"):  # fit, then validate: tokenize once
            return
        train = [pack_windows(self.tokenizer, corpus_texts(c, "train", self.corpus_chars), self.seq_len)
                 for c in CORPORA]
        self.train_windows = torch.cat(train)
        log.info("%d training windows of %d tokens", len(self.train_windows), self.seq_len)
        self.val_sets = [
            pack_windows(self.tokenizer, corpus_texts(c, "validation", self.corpus_chars), self.seq_len)[: self.val_windows]
            for c in CORPORA
        ]

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(TensorDataset(self.train_windows), batch_size=self.batch_size, drop_last=True,
                               sampler=SeededOrder(len(self.train_windows), self.seed))

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(TensorDataset(w), batch_size=self.batch_size) for w in self.val_sets]


class StepStatus(L.Callback):
    """A one-line status every `every` steps, readable in logs where no progress bar renders."""

    def __init__(self, every: int = 25):
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            log.info("step %d/%d  loss %.3f", step, trainer.max_steps, float(outputs["loss"]))


class ValidationCurve(L.Callback):
    """Validation loss per corpus at every validation, kept in checkpoints so that a resumed
    build reports its whole curve."""

    def __init__(self):
        self.points: list[dict] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        losses = {c: float(trainer.callback_metrics[f"val/loss/{c}"]) for c in CORPORA}
        point = {"step": trainer.global_step, "val_loss": losses}
        self.points = [p for p in self.points if p["step"] != point["step"]] + [point]
        log.info("step %d  validation loss %s", trainer.global_step, {c: round(v, 3) for c, v in losses.items()})

    def last_tenth_improvement(self, max_steps: int) -> dict[str, float] | None:
        """Per corpus, the relative drop of validation loss over the last tenth of the steps
        (from the last validation at or before 90% of them); None without such a point."""
        before = [p for p in self.points if p["step"] <= 0.9 * max_steps]
        if not before or not self.points:
            return None
        start, end = before[-1]["val_loss"], self.points[-1]["val_loss"]
        return {c: (start[c] - end[c]) / start[c] for c in start}

    def state_dict(self) -> dict:
        return {"points": self.points}

    def load_state_dict(self, state_dict: dict) -> None:
        self.points = state_dict["points"]


class TrainClock(L.Callback):
    """Seconds since construction plus those of earlier runs of the same build (restored from
    the checkpoint a build resumes from)."""

    def __init__(self):
        self.started, self.before = time.monotonic(), 0.0

    def seconds(self) -> float:
        return self.before + time.monotonic() - self.started

    def state_dict(self) -> dict:
        return {"seconds": self.seconds()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.before = state_dict["seconds"]


class CheckpointOnInterrupt(L.Callback):
    """Saves the training state when training stops on an exception or Ctrl-C, so a rerun
    resumes from the step reached, not from the last periodic checkpoint. (Lightning's
    OnExceptionCheckpoint deletes its file at teardown.)"""

    def __init__(self, path):
        self.path = str(path)

    def on_exception(self, trainer, pl_module, exception) -> None:
        trainer.save_checkpoint(self.path)


class MoECausalLM(L.LightningModule):
    """A transformers MoE causal LM trained with its own loss (which includes transformers'
    load-balancing loss) plus a per-layer balance term.

    transformers pools expert counts and router probabilities over all layers before it takes
    their product, so one layer may leave experts idle as long as other layers use them; the
    mean of the same loss taken layer by layer (`layer_balance_coef`) keeps each layer balanced.
    """

    def __init__(self, config: MixtralConfig, lr: float, warmup_steps: int, max_steps: int, weight_decay: float,
                 layer_balance_coef: float = 0.0):
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.model = MixtralForCausalLM(config)
        self.expert_load = torch.zeros(config.num_hidden_layers, config.num_local_experts, dtype=torch.long)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_router_logits=True)
        config = self.model.config
        layer_balance = torch.stack([
            load_balancing_loss_func((logits,), config.num_local_experts, config.num_experts_per_tok)
            for logits in out.router_logits
        ]).mean()
        self.log("train/loss", out.loss, prog_bar=True)
        self.log("train/aux_loss", out.aux_loss)
        self.log("train/layer_balance", layer_balance)
        return out.loss + self.hparams.layer_balance_coef * layer_balance

    def on_validation_epoch_start(self) -> None:
        self.expert_load.zero_()

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_router_logits=True)
        corpus = CORPORA[dataloader_idx]
        self.log(f"val/loss/{corpus}", out.loss - self.model.router_aux_loss_coef * out.aux_loss,
                 add_dataloader_idx=False, prog_bar=True)
        k = self.model.config.num_experts_per_tok
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(k, dim=-1).indices.flatten().cpu()
            self.expert_load[layer] += torch.bincount(chosen, minlength=self.expert_load.shape[1])

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95))

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                                                   "interval": "step"}}
