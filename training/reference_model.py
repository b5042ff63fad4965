"""`prescient reference-model`: build the project's own MoE, since no model hub is reachable.

tiny   a Mixtral-architecture MoE (configs/reference/tiny.yaml) with a byte-level BPE
       tokenizer, trained with Lightning on both built-in corpora.
bench  tiny with every expert widened by zero rows/columns (configs/reference/bench.yaml):
       over 2 GB of experts on disk, the same outputs and routing.

Both are ordinary Hugging Face model directories. A finished directory carries
`reference.json` (recipe, validation loss, expert load); a later call with the same recipe
returns it at once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError
from training.reference_lm import CORPORA, MoECausalLM, PackedCorporaData, StepStatus, corpus_texts
from training.tokenizer import train_byte_level_bpe

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "reference"
SIZES = ("tiny", "bench")
REPORT = "reference.json"


def recipe(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown reference size {size!r}; choose one of {', '.join(SIZES)}")
    spec = yaml.safe_load((CONFIG_DIR / f"{size}.yaml").read_text())
    if "base" in spec:
        spec = {**spec, "base_recipe": recipe(spec["base"])}
    return spec


class ReferenceModelError(PrescientError):
    """A reference model folder holds a damaged report."""


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


def build_reference_model(size: str = "tiny", out: str | Path | None = None) -> Path:
    """Build (or reuse) the reference model of `size` in `out`; returns the model directory."""
    out = Path(out) if out is not None else Path("runs") / f"reference-{size}"
    spec = recipe(size)
    if cached(out, spec):
        log.info("reference model %s already built in %s", size, out)
        return out
    if size == "bench":
        widen_experts(build_reference_model("tiny", out.parent / f"{out.name}-base"), out, spec)
    else:
        train_tiny(out, spec)
    return out


def train_tiny(out: Path, spec: dict) -> None:
    start = time.time()
    L.seed_everything(spec["seed"], workers=True, verbose=False)
    tcfg, mcfg, train = spec["tokenizer"], spec["model"], spec["training"]
    log.info("training a %d-token byte-level BPE tokenizer on both corpora", tcfg["vocab_size"])
    texts = [t for corpus in CORPORA for t in corpus_texts(corpus, "train", tcfg["train_chars"])]
    tokenizer = train_byte_level_bpe(texts, tcfg["vocab_size"])
    config = MixtralConfig(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, **mcfg,
    )
    module = MoECausalLM(config, lr=train["lr"], warmup_steps=train["warmup_steps"], max_steps=train["max_steps"],
                         weight_decay=train["weight_decay"],
                         layer_balance_coef=train["layer_balance_coef"])
    data = PackedCorporaData(tokenizer, train["seq_len"], train["batch_size"], tcfg["train_chars"],
                             train["val_windows"], spec["seed"])
    trainer = L.Trainer(
        max_steps=train["max_steps"], accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, val_check_interval=train["max_steps"], check_val_every_n_epoch=None,
        num_sanity_val_steps=0, gradient_clip_val=1.0, default_root_dir=str(out.parent),
        enable_progress_bar=False, callbacks=[StepStatus()],
    )
    trainer.fit(module, datamodule=data)
    metrics = trainer.validate(module, datamodule=data, verbose=False)
    val_loss = {corpus: float(m[f"val/loss/{corpus}"]) for corpus, m in zip(CORPORA, metrics)}
    out.mkdir(parents=True, exist_ok=True)
    module.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "recipe": spec,
        "size": "tiny",
        "train_seconds": round(time.time() - start, 1),
        "val_loss": val_loss,
        "expert_load": load_shares(module.expert_load),
    }
    write_json_atomic(out / REPORT, report)  # written last: its presence marks a finished build
    log.info("validation loss %s", {k: round(v, 3) for k, v in val_loss.items()})
    for layer, shares in enumerate(report["expert_load"]):
        log.info("layer %d expert load: %s", layer, " ".join(f"{s:.3f}" for s in shares))


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
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    base_report = json.loads((base_dir / REPORT).read_text())
    write_json_atomic(out / REPORT, {**base_report, "recipe": spec, "size": "bench", "base": str(base_dir)})
