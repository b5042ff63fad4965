"""The model fingerprint: what a trace or predictor was built for.

Two models share a fingerprint when they route identically: same architecture, same
MoE shape, same vocabulary, and the same tensors outside the routed experts (those are
what decide the hidden states every router sees). Routed expert tensors are left out of
the hash on purpose: hashing gigabytes of experts on every load would be slow, and the
zero-widened `bench` reference model, which routes exactly like `tiny`, then shares its
fingerprint, so predictors trained on `tiny` serve `bench`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from weakref import WeakKeyDictionary
from pathlib import Path

import torch
from torch import nn

from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import FingerprintMismatchError
from prescient.loading import load_without_experts
from prescient.model_dir import ModelDirectory


@dataclass(frozen=True)
class ModelFingerprint:
    arch: str  # config.model_type
    n_moe_layers: int
    n_experts: int
    top_k: int
    vocab_size: int
    weights_hash: str  # sha256 prefix over every tensor outside the routed experts

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFingerprint":
        """Raises KeyError for a missing field, ValueError for a field of the wrong type or range."""
        values = {k: data[k] for k in cls.__dataclass_fields__}
        for name in ("arch", "weights_hash"):
            if not isinstance(values[name], str) or not values[name]:
                raise ValueError(f"fingerprint field {name} is {values[name]!r}, not a name")
        for name in ("n_moe_layers", "n_experts", "top_k", "vocab_size"):
            if type(values[name]) is not int or values[name] < 1:
                raise ValueError(f"fingerprint field {name} is {values[name]!r}, not a positive whole number")
        if values["top_k"] > values["n_experts"]:
            raise ValueError(f"fingerprint top_k {values['top_k']} exceeds n_experts {values['n_experts']}")
        return cls(**values)

    def __str__(self) -> str:
        return (
            f"{self.arch}(L={self.n_moe_layers}, E={self.n_experts}, k={self.top_k}, "
            f"vocab={self.vocab_size}, hash={self.weights_hash})"
        )

    def require_same(self, other: "ModelFingerprint", what: str) -> None:
        """Raise a clear error if `other` (the artifact's fingerprint) is not this model's."""
        if other != self:
            raise FingerprintMismatchError(what, expected=self, found=other)


def expert_tensor_names(layers: list[MoELayer]) -> set[str]:
    """Fully qualified names of all routed-expert tensors."""
    return {
        f"{layer.name}.experts.{param}" for layer in layers for param in layer.adapter.expert_param_names(layer)
    }


def fingerprint_model(model: nn.Module, layers: list[MoELayer] | None = None) -> ModelFingerprint:
    layers = layers if layers is not None else find_moe_layers(model)
    skip = expert_tensor_names(layers)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name in skip or tensor.device.type == "meta":
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    n_experts = {layer.num_experts for layer in layers}
    top_k = {layer.top_k for layer in layers}
    if len(n_experts) != 1 or len(top_k) != 1:
        raise NotImplementedError(
            f"MoE layers differ in expert count {sorted(n_experts)} or top-k {sorted(top_k)}; "
            "per-layer shapes are not supported yet."
        )
    config = model.config
    return ModelFingerprint(
        arch=str(config.model_type),
        n_moe_layers=len(layers),
        n_experts=n_experts.pop(),
        top_k=top_k.pop(),
        vocab_size=int(config.get_text_config().vocab_size),
        weights_hash=digest.hexdigest()[:16],
    )


def loaded_fingerprint(model_dir: str | Path | ModelDirectory, model: nn.Module, layers: list[MoELayer],
                       dtype: torch.dtype) -> ModelFingerprint:
    """The fingerprint of the model saved in `model_dir`, which `model` is, loaded in `dtype`.
    Fingerprints hash the float32 reading (traces and predictors are built from it); a model
    loaded in another dtype holds other bytes, so its fingerprint is read from the directory."""
    return fingerprint_model(model, layers) if dtype == torch.float32 else fingerprint_model_dir(model_dir)


def fingerprint_model_dir(model_dir: str | Path | ModelDirectory) -> ModelFingerprint:
    """The fingerprint of the model saved in `model_dir` (read without its routed experts, as the
    offloading runtime reads it, in float32); an opened directory computes it once."""
    directory = ModelDirectory.of(model_dir)
    if directory not in _DIRECTORY_FINGERPRINTS:
        _DIRECTORY_FINGERPRINTS[directory] = fingerprint_model(*load_without_experts(directory, dtype=torch.float32))
    return _DIRECTORY_FINGERPRINTS[directory]


_DIRECTORY_FINGERPRINTS: WeakKeyDictionary[ModelDirectory, ModelFingerprint] = WeakKeyDictionary()
