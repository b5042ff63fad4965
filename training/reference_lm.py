"""Lightning pieces that train the reference MoE: packed text windows and a causal-LM module."""

from __future__ import annotations

import logging
import math

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

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


def corpus_texts(spec: str, split: str, max_chars: int) -> list[str]:
    """The first documents of a split, up to about `max_chars` characters."""
    texts, total = [], 0
    for text in load_corpus(spec, split)["text"]:
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


class PackedCorporaData(L.LightningDataModule):
    """Both built-in corpora, tokenized and packed; validation keeps each corpus apart."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, seq_len: int, batch_size: int,
                 train_chars: int, val_windows: int, seed: int):
        super().__init__()
        self.tokenizer, self.seq_len, self.batch_size = tokenizer, seq_len, batch_size
        self.train_chars, self.val_windows, self.seed = train_chars, val_windows, seed

    def setup(self, stage: str | None = None) -> None:
        train = [pack_windows(self.tokenizer, corpus_texts(c, "train", self.train_chars), self.seq_len) for c in CORPORA]
        self.train_windows = torch.cat(train)
        self.val_sets = [
            pack_windows(self.tokenizer, corpus_texts(c, "validation", self.train_chars), self.seq_len)[: self.val_windows]
            for c in CORPORA
        ]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(TensorDataset(self.train_windows), batch_size=self.batch_size, shuffle=True,
                          drop_last=True, generator=generator)

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
