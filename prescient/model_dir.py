"""`ModelDirectory`: a local Hugging Face model directory, opened once where a command starts and
passed down, as transformers passes a `PretrainedConfig`.

Opening checks what a model directory must hold (an existing folder, a `config.json` that parses
and that transformers' typed fields accept, readable `*.safetensors` files that a sharded index
lists completely) with one-line `ModelFilesError`s, and keeps what it read: the raw settings, the
typed config, and which file holds each checkpoint tensor. The tokenizer is read on first use
and kept too (and the fingerprint, by `prescient.fingerprint.fingerprint_model_dir`). Every
function that takes a model directory takes a path or this object (`ModelDirectory.of`), so a
command parses its model once however deep the calls go.
"""

from __future__ import annotations

import copy
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PretrainedConfig,
                          PreTrainedModel)

from prescient.checkpoint_schemes import CheckpointSchemes
from prescient.errors import ModelFilesError


class ModelDirectory(os.PathLike):
    """An opened model directory: `path`, `config_dict` (config.json as written), `config`
    (transformers' typed config; a compressed checkpoint's `quantization_config` is in both),
    `weight_files`, `weight_index` (checkpoint tensor name → the file holding it), and on first use
    `tokenizer()` and `compression` (the checked quantization schemes). It is a path-like
    (`os.fspath` gives its folder) and prints as its folder, so messages read as they did with a
    path. Treat it as read-only: `config` is shared; `weightless_model` builds from a copy."""

    def __init__(self, path: Path, config_dict: dict[str, Any], config: PretrainedConfig,
                 weights: dict[Path, list[str]]) -> None:
        self.path = path
        self.config_dict = config_dict
        self.config = config
        self.weight_files = list(weights)  # sorted
        self.weight_index = {key: file for file, keys in weights.items() for key in keys}  # a later file's wins
        self._tokenizer = None

    @classmethod
    def open(cls, path: str | Path) -> ModelDirectory:
        """The directory at `path`, checked; a `ModelFilesError` naming what is missing or corrupt."""
        path = Path(path)
        if not path.exists():
            raise ModelFilesError(f"model directory {path} does not exist; give the path of a Hugging Face model "
                                  "directory")
        if not (path / "config.json").exists():
            raise ModelFilesError(f"{path} has no config.json; expected a Hugging Face model directory")
        try:
            config_dict = json.loads((path / "config.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFilesError(f"{path / 'config.json'} is not valid JSON ({exc}); restore the model directory"
                                  ) from None
        if not isinstance(config_dict, dict):
            raise ModelFilesError(f"{path / 'config.json'} holds a JSON {type(config_dict).__name__}, not an object "
                                  "of settings; restore the model directory")
        try:  # transformers' own checks of each field's type
            config = AutoConfig.from_pretrained(path)
        except StrictDataclassError as exc:
            raise ModelFilesError(f"{path / 'config.json'}: {exc}; correct the field or restore the model directory"
                                  ) from None
        return cls(path, config_dict, config, _read_weight_files(path))

    @classmethod
    def of(cls, model_dir: str | Path | ModelDirectory) -> ModelDirectory:
        """`model_dir` itself when already opened, else the directory at that path opened."""
        return model_dir if isinstance(model_dir, ModelDirectory) else cls.open(model_dir)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"ModelDirectory({str(self.path)!r})"

    def checkpoint_key(self, name: str) -> str | None:
        """The weight files' name for model tensor `name` (with or without the base model's prefix)."""
        return next((key for key in checkpoint_names(name) if key in self.weight_index), None)

    def weightless_model(self, dtype: torch.dtype | None = None) -> PreTrainedModel:
        """The model built from `config` (in `dtype`, else the config's) with its parameters on
        the meta device (shapes and dtypes only; buffers computed as usual): what loading without
        the experts fills, what finds the checkpoint names of the experts and the input
        embedding, and what maps modules to devices."""
        config = copy.deepcopy(self.config)  # building sets the config's dtype
        with init_empty_weights(include_buffers=False):  # no dtype: the config's own
            return model_class(config).from_config(config, **({} if dtype is None else {"dtype": dtype}))

    def tokenizer(self):
        """The model's tokenizer (`load_tokenizer`), read on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @cached_property
    def compression(self) -> CheckpointSchemes | None:
        """The compression schemes its `quantization_config` declares, checked (None: not compressed)."""
        return CheckpointSchemes.of(self.config_dict, str(self.path / "config.json"))


def model_class(config: PretrainedConfig) -> type:
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files, each checked to open; errors name the file.

    A sharded model's index (`*.safetensors.index.json`) must name only files that exist.
    """
    return list(_read_weight_files(Path(model_dir)))


def _read_weight_files(model_dir: Path) -> dict[Path, list[str]]:
    """The directory's safetensors files (sorted) and the tensor names of each; the errors of `weight_files`."""
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
    keys = {}
    for path in files:
        try:
            keys[path] = tensor_keys(path)
        except (SafetensorError, OSError) as exc:
            raise ModelFilesError(f"weight file {path} is corrupt or unreadable ({exc})") from exc
    return keys


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
