"""Architecture adapters: find a transformers model's MoE blocks, their routers and experts.

Each adapter knows one family of MoE block and is registered by name (the style of
transformers' `ExpertsInterface`). Tracing hooks the routers an adapter finds; the
offloading runtime swaps the experts modules it finds. No transformers code is edited.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from prescient.errors import NotAMoEModelError


@dataclass
class MoELayer:
    """One MoE block of a model, in forward order."""

    index: int  # position among the model's MoE blocks, 0..L-1
    name: str  # module path of the block, e.g. "model.layers.3.mlp"
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    adapter: "ArchAdapter"

    @property
    def num_experts(self) -> int:
        return self.adapter.num_experts(self)

    @property
    def top_k(self) -> int:
        return self.adapter.top_k(self)


class ArchAdapter:
    """How to read one family of MoE block. Subclasses hold only what differs."""

    name: ClassVar[str]

    def matches(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def router(self, block: nn.Module) -> nn.Module:
        raise NotImplementedError

    def num_experts(self, layer: MoELayer) -> int:
        return int(layer.router.num_experts)

    def top_k(self, layer: MoELayer) -> int:
        raise NotImplementedError

    def routing(self, layer: MoELayer, router_output) -> tuple[torch.Tensor, torch.Tensor]:
        """Router output → (logits [..., E] as float32, selected expert ids [..., k])."""
        raise NotImplementedError

    def expert_param_names(self, layer: MoELayer) -> list[str]:
        """Names (relative to the experts module) of the tensors that hold routed experts."""
        return [name for name, _ in layer.experts.named_parameters()]


class FusedExpertsAdapter(ArchAdapter):
    """transformers 5 fused experts: `block.experts` holds [E, ...] tensors and the router
    (`block.gate` or `block.router`) returns (logits, top-k weights, top-k indices).

    Covers Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, PhiMoE, GraniteMoE and the
    other models built on `use_experts_implementation`.
    """

    name = "fused"
    _router_attrs = ("gate", "router")

    def matches(self, module: nn.Module) -> bool:
        experts = getattr(module, "experts", None)
        return (
            isinstance(experts, nn.Module)
            and hasattr(experts, "gate_up_proj")
            and any(isinstance(getattr(module, a, None), nn.Module) for a in self._router_attrs)
        )

    def router(self, block: nn.Module) -> nn.Module:
        for attr in self._router_attrs:
            found = getattr(block, attr, None)
            if isinstance(found, nn.Module):
                return found
        raise NotAMoEModelError(f"{type(block).__name__} has no router")

    def top_k(self, layer: MoELayer) -> int:
        return int(layer.router.top_k)

    def routing(self, layer, router_output):
        logits, _weights, indices = router_output
        return logits.float(), indices


class SwitchAdapter(ArchAdapter):
    """Switch Transformers: top-1 router returning (dispatch one-hot, probs, logits); one
    `expert_{i}` submodule per expert."""

    name = "switch"

    def matches(self, module: nn.Module) -> bool:
        return type(module).__name__ == "SwitchTransformersSparseMLP"

    def router(self, block: nn.Module) -> nn.Module:
        return block.router

    def top_k(self, layer: MoELayer) -> int:
        return 1

    def routing(self, layer, router_output):
        _dispatch, _probs, logits = router_output
        # The router's choice is its argmax; a capacity overflow drops the token's
        # computation, not its choice, so the trace records the choice.
        return logits.float(), logits.argmax(dim=-1, keepdim=True)


ADAPTERS: dict[str, ArchAdapter] = {a.name: a for a in (FusedExpertsAdapter(), SwitchAdapter())}


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """All MoE blocks of `model` in forward order (for encoder-decoders: encoder first)."""
    layers: list[MoELayer] = []
    for name, module in model.named_modules():
        for adapter in ADAPTERS.values():
            if adapter.matches(module):
                layers.append(
                    MoELayer(
                        index=len(layers),
                        name=name,
                        block=module,
                        router=adapter.router(module),
                        experts=module.experts,
                        adapter=adapter,
                    )
                )
                break
    if not layers:
        raise NotAMoEModelError(
            f"{type(model).__name__} has no mixture-of-experts block; expected a transformers MoE "
            f"model with one of these block kinds: {', '.join(ADAPTERS)} "
            "(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, PhiMoE, GraniteMoE, Switch Transformers, ...)."
        )
    return layers


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


@dataclass(frozen=True)
class MoEStack:
    """A module whose forward runs a contiguous range of the MoE layers over a token stream of
    its own: the whole model for a decoder; the encoder (the prompt) and the decoder (the
    start token, then each generated token) of an encoder-decoder."""

    module: nn.Module
    layers: range  # indices into find_moe_layers' list


def moe_stacks(model: nn.Module, layers: list[MoELayer]) -> list[MoEStack]:
    """The stacks that run `layers`, in forward order."""
    if not is_encoder_decoder(model):
        return [MoEStack(model, range(len(layers)))]
    in_encoder = {id(module) for module in model.get_encoder().modules()}
    n_encoder = sum(id(layer.block) in in_encoder for layer in layers)
    if any(id(layer.block) in in_encoder for layer in layers[n_encoder:]):
        raise NotAMoEModelError(f"{type(model).__name__}: encoder MoE layers do not all come before the decoder's")
    return [MoEStack(model.get_encoder(), range(n_encoder)),
            MoEStack(model.get_decoder(), range(n_encoder, len(layers)))]
