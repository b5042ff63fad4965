"""Load a transformers MoE model from a local directory (or a hub name) with clear errors."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import ModelFilesError
# load_tokenizer is defined with the model directory (whose `tokenizer()` keeps one); callers import it from here too
from prescient.model_dir import ModelDirectory, load_tokenizer, model_class  # noqa: F401

log = logging.getLogger(__name__)


def load_model(model: str | Path | ModelDirectory, dtype: torch.dtype | None = None,
               **kwargs) -> tuple[PreTrainedModel, list[MoELayer]]:
    """The model in eval mode and its MoE layers. A local path must be a model directory;
    anything else is taken as a hub name (needs the network)."""
    path = Path(model)
    if isinstance(model, ModelDirectory) or path.exists():
        config = ModelDirectory.of(model).config
    elif str(model).startswith((".", "/")) or path.suffix:
        raise ModelFilesError(f"model directory {path} does not exist; give the path of a Hugging Face model "
                              "directory")
    else:
        try:
            config = AutoConfig.from_pretrained(model)
        except OSError as exc:  # a hub name that cannot be fetched (no network, no such repo)
            raise ModelFilesError(f"cannot load model {model!r}: not a local directory, and the hub says: {exc}"
                                  ) from exc
    source = model.path if isinstance(model, ModelDirectory) else model
    loaded = model_class(config).from_pretrained(source, dtype=dtype or "auto", **kwargs)
    if dtype is not None and getattr(config, "quantization_config", None) is not None:
        # transformers expands a compressed checkpoint's weights in their scales' dtype; the model
        # then computes in `dtype` like any other (it refuses `.to(dtype)` on a quantised model)
        for tensor in loaded.parameters():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    loaded.eval()
    return loaded, find_moe_layers(loaded)


def load_without_experts(model_dir: str | Path | ModelDirectory,
                         dtype: torch.dtype) -> tuple[PreTrainedModel, list[MoELayer]]:
    """The model from a local directory with every tensor but the routed experts read from its
    safetensors files; the experts stay on the meta device (shapes and dtypes only), for an
    offloaded experts module to replace. Memory then holds the other weights alone, never the
    whole model. Where transformers converts more than the experts' tensors on loading (rather
    than only renaming them), this falls back to `load_model`, with a warning."""
    directory = ModelDirectory.of(model_dir)
    path = directory.path
    model = directory.weightless_model(dtype)
    layers = find_moe_layers(model)
    expert_ids = {id(param) for layer in layers for param in layer.experts.parameters()}
    wanted = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) not in expert_ids}
    checkpoint_name = {id(tensor): name for name, tensor in revert_weight_conversion(model, dict(wanted)).items()}
    if any(id(tensor) not in checkpoint_name for tensor in wanted.values()):
        log.warning("%s: transformers converts more than the experts on loading; loading the whole model", path)
        return load_model(directory, dtype=dtype)
    files = directory.weight_index
    for name, tensor in wanted.items():
        key = directory.checkpoint_key(checkpoint_name[id(tensor)])
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


def input_embedding_key(model_dir: str | Path | ModelDirectory) -> tuple[str, Path] | None:
    """The checkpoint key and file of the model's own input-embedding matrix (what
    `get_input_embeddings()` holds), found through transformers' own weight renaming on a
    weightless copy of the model: `transformer.wte.weight` (DBRX), `model.embeddings.weight`
    (Nemotron-H), `model.word_embeddings.weight` saved for `model.embed_tokens` (Bailing), ...
    None when the directory has no config or no such tensor."""
    if not isinstance(model_dir, ModelDirectory) and not (Path(model_dir) / "config.json").exists():
        return None
    directory = ModelDirectory.of(model_dir)
    model = directory.weightless_model()
    weight = model.get_input_embeddings().weight
    names = {name: weight for name, param in model.named_parameters(remove_duplicate=False) if param is weight}
    for checkpoint_name in sorted(revert_weight_conversion(model, names), key=len):
        key = directory.checkpoint_key(checkpoint_name)
        if key is not None:
            return key, directory.weight_index[key]
    return None
