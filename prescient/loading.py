"""Load a transformers MoE model from a local directory (or a hub name) with clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, PreTrainedModel,
)
from transformers.core_model_loading import revert_weight_conversion

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


def check_model_dir(path: Path) -> list[Path]:
    """A local model directory's weight files; clear errors for what is missing or corrupt."""
    if not path.exists():
        raise ModelFilesError(f"model directory {path} does not exist; give the path of a Hugging Face model "
                              "directory")
    if not (path / "config.json").exists():
        raise ModelFilesError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFilesError(f"{path / 'config.json'} is not valid JSON ({exc}); restore the model directory"
                              ) from None
    if not isinstance(config, dict):
        raise ModelFilesError(f"{path / 'config.json'} holds a JSON {type(config).__name__}, not an object of "
                              "settings; restore the model directory")
    try:  # transformers' own checks of each field's type
        AutoConfig.from_pretrained(path)
    except StrictDataclassError as exc:
        raise ModelFilesError(f"{path / 'config.json'}: {exc}; correct the field or restore the model directory"
                              ) from None
    return weight_files(path)


def model_class(config) -> type:
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def load_model(model: str | Path, dtype: torch.dtype | None = None, **kwargs) -> tuple[PreTrainedModel, list[MoELayer]]:
    """The model in eval mode and its MoE layers. A local path must be a model directory;
    anything else is taken as a hub name (needs the network)."""
    path = Path(model)
    if path.exists():
        check_model_dir(path)
    elif str(model).startswith((".", "/")) or path.suffix:
        raise ModelFilesError(f"model directory {path} does not exist; give the path of a Hugging Face model "
                              "directory")
    try:
        config = AutoConfig.from_pretrained(model)
    except OSError as exc:  # a hub name that cannot be fetched (no network, no such repo)
        raise ModelFilesError(f"cannot load model {model!r}: not a local directory, and the hub says: {exc}") from exc
    loaded = model_class(config).from_pretrained(model, dtype=dtype or "auto", **kwargs)
    if dtype is not None and getattr(config, "quantization_config", None) is not None:
        # transformers expands a compressed checkpoint's weights in their scales' dtype; the model
        # then computes in `dtype` like any other (it refuses `.to(dtype)` on a quantised model)
        for tensor in loaded.parameters():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    loaded.eval()
    return loaded, find_moe_layers(loaded)


def load_without_experts(model_dir: str | Path, dtype: torch.dtype) -> tuple[PreTrainedModel, list[MoELayer]]:
    """The model from a local directory with every tensor but the routed experts read from its
    safetensors files; the experts stay on the meta device (shapes and dtypes only), for an
    offloaded experts module to replace. Memory then holds the other weights alone, never the
    whole model. Where transformers converts more than the experts' tensors on loading (rather
    than only renaming them), this falls back to `load_model`, with a warning."""
    path = Path(model_dir)
    weights = check_model_dir(path)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config, dtype=dtype)
    layers = find_moe_layers(model)
    expert_ids = {id(param) for layer in layers for param in layer.experts.parameters()}
    wanted = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) not in expert_ids}
    checkpoint_name = {id(tensor): name for name, tensor in revert_weight_conversion(model, dict(wanted)).items()}
    if any(id(tensor) not in checkpoint_name for tensor in wanted.values()):
        log.warning("%s: transformers converts more than the experts on loading; loading the whole model", path)
        return load_model(path, dtype=dtype)
    files = {key: file for file in weights for key in tensor_keys(file)}
    for name, tensor in wanted.items():
        key = next((k for k in checkpoint_names(checkpoint_name[id(tensor)]) if k in files), None)
        if key is None:
            continue  # tied to another tensor, or a buffer the model computes itself: checked below
        with safe_open(str(files[key]), framework="pt") as handle:
            value = handle.get_tensor(key)
        if tuple(value.shape) != tuple(tensor.shape):
            raise ModelFilesError(f"{key} in {files[key].name} has shape {list(value.shape)}, the model expects "
                                  f"{list(tensor.shape)}")
        set_module_tensor_to_device(model, name, "cpu", value=value, dtype=tensor.dtype)
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta" and id(param) not in expert_ids]
    if missing:
        raise ModelFilesError(f"{path} lacks weights the model needs: {missing[:5]}")
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    return model, layers


def input_embedding_key(model_dir: str | Path) -> tuple[str, Path] | None:
    """The checkpoint key and file of the model's own input-embedding matrix (what
    `get_input_embeddings()` holds), found through transformers' own weight renaming on a
    weightless copy of the model: `transformer.wte.weight` (DBRX), `model.embeddings.weight`
    (Nemotron-H), `model.word_embeddings.weight` saved for `model.embed_tokens` (Bailing), ...
    None when the directory has no config or no such tensor."""
    path = Path(model_dir)
    if not (path / "config.json").exists():
        return None
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config)
    weight = model.get_input_embeddings().weight
    names = {name: weight for name, param in model.named_parameters(remove_duplicate=False) if param is weight}
    files = {key: file for file in weight_files(path) for key in tensor_keys(file)}
    for checkpoint_name in sorted(revert_weight_conversion(model, names), key=len):
        key = next((k for k in checkpoint_names(checkpoint_name) if k in files), None)
        if key is not None:
            return key, files[key]
    return None


def tensor_keys(file: Path) -> list[str]:
    """The tensor names of one safetensors file."""
    with safe_open(str(file), framework="pt") as handle:
        return list(handle.keys())


def checkpoint_names(key: str) -> tuple[str, ...]:
    """A checkpoint may name tensors with or without the base model's prefix."""
    return key, key.split(".", 1)[-1], f"model.{key}"


def load_tokenizer(model: str | Path):
    """The model's tokenizer (pad = eos when it has no pad token); `ModelFilesError` when the
    directory holds none that loads."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:240] or type(exc).__name__  # one line
        raise ModelFilesError(f"cannot load the tokenizer of {model} ({reason}); expected tokenizer files "
                              "(tokenizer.json, tokenizer_config.json) in the model directory") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
