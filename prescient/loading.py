"""Load a transformers MoE model from a local directory (or a hub name) with clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel

from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import ModelFilesError

log = logging.getLogger(__name__)


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files, each checked to open; errors name the file.

    A sharded model's index (`*.safetensors.index.json`) must name only files that exist.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    for index in model_dir.glob("*.safetensors.index.json"):
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ModelFilesError(f"weight index {index} is corrupt ({exc})") from exc
        missing = sorted(name for name in listed if not (model_dir / name).is_file())
        if missing:
            raise ModelFilesError(f"weight file {model_dir / missing[0]} listed in {index.name} is missing"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not files:
        raise ModelFilesError(f"{model_dir} holds no *.safetensors weight files; expected a Hugging Face model directory")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise ModelFilesError(f"weight file {path} is corrupt or unreadable ({exc})") from exc
    return files


def model_class(config) -> type:
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def load_model(model: str | Path, dtype: torch.dtype | None = None, **kwargs) -> tuple[PreTrainedModel, list[MoELayer]]:
    """The model in eval mode and its MoE layers. A local path must be a model directory;
    anything else is taken as a hub name (needs the network)."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelFilesError(f"{path} has no config.json; expected a Hugging Face model directory")
        weight_files(path)
    elif str(model).startswith((".", "/")) or path.suffix:
        raise ModelFilesError(f"model directory {path} does not exist")
    try:
        config = AutoConfig.from_pretrained(model)
    except OSError as exc:  # a hub name that cannot be fetched (no network, no such repo)
        raise ModelFilesError(f"cannot load model {model!r}: not a local directory, and the hub says: {exc}") from exc
    loaded = model_class(config).from_pretrained(model, dtype=dtype or "auto", **kwargs)
    loaded.eval()
    return loaded, find_moe_layers(loaded)


def load_tokenizer(model: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
