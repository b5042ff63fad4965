"""`prescient reference-model`: build the project's own MoE, since no model hub is reachable.

base   the reference: a Mixtral-architecture MoE (configs/reference/base.yaml) with a
       byte-level BPE tokenizer, trained with Lightning on both built-in corpora until its
       validation loss flattens; benchmarks and quality measurements use it.
tiny   a smaller, shorter recipe of base that fits the demo's budget.
bench  base with every expert widened by zero rows/columns (configs/reference/bench.yaml):
       over 2 GB of experts on disk, the same outputs and routing.

All are ordinary Hugging Face model directories. A finished directory carries
`reference.json` (recipe, validation-loss curve, routing statistics); a later call with the
same recipe returns it at once. Training checkpoints to `DIR/.train/` as it goes, so an
interrupted build (a crash, Ctrl-C, SIGTERM, a full disk) resumes where it stopped when run again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, PreTrainedTokenizerFast

from prescient.atomic import write_errors, write_json_atomic
from training.reference_lm import (CORPORA, CheckpointOnInterrupt, MoECausalLM, PackedCorporaData, StepStatus,
                                   TrainClock, ValidationCurve, corpus_texts)
from training.reference_recipe import ReferenceModelError, read_recipe, recipe
from training.routing_stats import routing_statistics
from training.tokenizer import train_byte_level_bpe

log = logging.getLogger(__name__)

REPORT = "reference.json"
TRAIN_DIR = ".train"  # checkpoints, tokenizer and recipe of a build in progress


def cached(out: Path, spec: dict) -> bool:
    """Whether `out` holds the reference model of `spec` already (its report names the recipe)."""
    report = out / REPORT
    if not report.exists():
        return False
    try:
        recorded = json.loads(report.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReferenceModelError(f"{report} is not valid JSON ({exc}); delete {out} to build the model again, "
                                  "or choose another --out") from None
    if not isinstance(recorded, dict):
        raise ReferenceModelError(f"{report} is not a reference model report; delete {out} to build the model again, "
                                  "or choose another --out")
    return recorded.get("recipe") == spec


def build_reference_model(size: str = "tiny", out: str | Path | None = None, recipe_file: str | Path | None = None) -> Path:
    """Build (or reuse) the reference model of `size` (or of the recipe in `recipe_file`) in
    `out`; returns the model directory."""
    spec = read_recipe(recipe_file) if recipe_file is not None else recipe(size)
    name = Path(recipe_file).stem if recipe_file is not None else size
    out = Path(out) if out is not None else Path("runs") / f"reference-{name}"
    if cached(out, spec):
        log.info("reference model %s already built in %s", name, out)
        return out
    with write_errors(out):  # a full disk, a folder that cannot hold files: one error naming `out`
        if "base" in spec:
            widen_experts(build_reference_model(spec["base"], out.parent / f"{out.name}-base"), out, spec)
        else:
            train_reference(out, spec, name)
    return out


def train_reference(out: Path, spec: dict, name: str) -> None:
    """Train the model of `spec` into `out`, resuming from `out/.train/` when it holds a
    checkpoint of the same recipe."""
    clock = TrainClock()  # seconds over every run of this build, an interrupted one included
    L.seed_everything(spec["seed"], workers=True, verbose=False)
    mcfg, train = spec["model"], spec["training"]
    work = out / TRAIN_DIR
    resume = _resumable(work, spec)
    tokenizer = _tokenizer(work, spec, fresh=resume is None)
    config = MixtralConfig(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, **mcfg,
    )
    module = MoECausalLM(config, lr=train["lr"], warmup_steps=train["warmup_steps"], max_steps=train["max_steps"],
                         weight_decay=train["weight_decay"], layer_balance_coef=train["layer_balance_coef"])
    data = PackedCorporaData(tokenizer, train["seq_len"], train["batch_size"], train["corpus_chars"],
                             train["val_windows"], spec["seed"])
    curve = ValidationCurve()
    trainer = L.Trainer(
        max_steps=train["max_steps"], accelerator="cpu", devices=1, logger=False,
        val_check_interval=train["val_every"], check_val_every_n_epoch=None,
        num_sanity_val_steps=0, gradient_clip_val=1.0, default_root_dir=str(work),
        enable_progress_bar=sys.stderr.isatty(),
        callbacks=[StepStatus(), curve, clock, CheckpointOnInterrupt(work / "last.ckpt"),
                   ModelCheckpoint(dirpath=work, save_last=True, save_top_k=0,
                                   every_n_train_steps=min(100, train["val_every"]))],
    )
    if resume is not None:
        log.info("resuming %s from %s", name, resume)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    if trainer.global_step < train["max_steps"]:
        raise ReferenceModelError(f"training of {out} stopped at step {trainer.global_step}; run again to resume")
    if not curve.points or curve.points[-1]["step"] != train["max_steps"]:
        trainer.validate(module, datamodule=data, verbose=False)
    module.model.eval()
    stats = routing_statistics(module.model, data.train_windows[: 4 * train["val_windows"]], data.val_sets[0])
    _save_into(out, module.model, tokenizer)
    report = {
        "recipe": spec,
        "size": name,
        "train_seconds": round(clock.seconds(), 1),
        "val_loss": curve.points[-1]["val_loss"],
        "val_curve": curve.points,
        "last_tenth_improvement": curve.last_tenth_improvement(train["max_steps"]),
        "expert_load": load_shares(module.expert_load),
        "routing": stats,
    }
    write_json_atomic(out / REPORT, report)  # written last: its presence marks a finished build
    shutil.rmtree(work, ignore_errors=True)
    log.info("validation loss %s after %.0f s", {k: round(v, 3) for k, v in report["val_loss"].items()},
             report["train_seconds"])


def _resumable(work: Path, spec: dict) -> str | None:
    """The checkpoint to resume from: `work/last.ckpt` if `work` was started with this recipe."""
    started = work / "recipe.json"
    if (work / "last.ckpt").exists() and started.exists() and json.loads(started.read_text()) == spec:
        return str(work / "last.ckpt")
    shutil.rmtree(work, ignore_errors=True)  # another recipe's (or no) progress: start over
    work.mkdir(parents=True)
    write_json_atomic(started, spec)
    return None


def _tokenizer(work: Path, spec: dict, fresh: bool) -> PreTrainedTokenizerFast:
    """The recipe's BPE tokenizer, trained once per build and kept in `work` for a resume."""
    saved = work / "tokenizer"
    if not fresh and saved.exists():
        return AutoTokenizer.from_pretrained(saved)
    tcfg = spec["tokenizer"]
    log.info("training a %d-token byte-level BPE tokenizer on both corpora", tcfg["vocab_size"])
    texts = [t for corpus in CORPORA for t in corpus_texts(corpus, "train", tcfg["train_chars"])]
    tokenizer = train_byte_level_bpe(texts, tcfg["vocab_size"])
    tokenizer.save_pretrained(saved)
    return tokenizer


def _save_into(out: Path, *parts) -> None:
    """`save_pretrained` each of `parts` (model, tokenizer) into a hidden folder of `out`, then move
    each file into `out`: a write that fails (a full disk) leaves no torn file there."""
    staging = out / ".saving"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for part in parts:
            part.save_pretrained(staging)
        for file in staging.iterdir():
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_shares(counts: torch.Tensor) -> list[list[float]]:
    """Per layer, each expert's share of the top-k selections."""
    return (counts.float() / counts.sum(dim=1, keepdim=True).clamp(min=1)).tolist()


@torch.no_grad()
def widen_experts(base_dir: Path, out: Path, spec: dict) -> None:
    """Zero-pad every expert's intermediate dimension to `expert_intermediate_size`."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    wide = spec["expert_intermediate_size"]
    narrow = model.config.intermediate_size
    if wide < narrow:
        raise ValueError(f"expert_intermediate_size {wide} is below the base model's {narrow}")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        gate, up = experts.gate_up_proj.data.chunk(2, dim=1)  # [E, I, H] each
        pad = torch.zeros(gate.shape[0], wide - narrow, gate.shape[2])
        experts.gate_up_proj = torch.nn.Parameter(torch.cat([gate, pad, up, pad], dim=1))
        down = experts.down_proj.data  # [E, H, I]
        experts.down_proj = torch.nn.Parameter(torch.cat([down, torch.zeros(*down.shape[:2], wide - narrow)], dim=2))
        experts.intermediate_dim = wide
    model.config.intermediate_size = wide
    _save_into(out, model, AutoTokenizer.from_pretrained(base_dir))
    base_report = json.loads((base_dir / REPORT).read_text())
    write_json_atomic(out / REPORT, {**base_report, "recipe": spec, "size": "bench", "base": str(base_dir)})
