"""Architecture adapters: find a transformers model's MoE blocks, their routers and experts.

Routers are found the way transformers itself records them: each MoE model declares, in its
`_can_record_outputs["router_logits"]`, the router class and which output of it holds the router
logits. Every module of that class is a router; its parent is the MoE block (a decoder layer, for
Gemma 4), and the parent's `experts` module holds the routed experts. How the block calls its
experts picks the adapter, registered by name (the style of transformers' `ExpertsInterface`):

- "fused": `experts(hidden_states, top_k_index, top_k_weights)` (Mixtral, DeepSeek, Qwen, Gemma 4,
  GPT-OSS, DBRX, LongCat-Flash, ... most of transformers 5);
- "dense": `experts(hidden_states)`, every expert reading every token's row scaled by its router
  score, zero where not chosen (Llama 4);
- "switch": Switch Transformers' one `expert_{i}` module per expert and a one-hot dispatch mask.

Families that are MoE models but whose experts cannot be offloaded without changing what they
compute are refused by `REFUSALS`, with the reason. Tracing hooks the routers an adapter finds;
the offloading runtime swaps the experts modules. No transformers code is edited.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from prescient.errors import NotAMoEModelError

# attributes that hold a layer's top-k, looked up on the router, the block, the experts, then the config
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts",
                "moe_top_k")
# attributes of an experts module that count its weight-holding experts, in order of preference
_COUNT_ATTRS = ("num_experts", "num_routed_experts", "num_local_experts")


class UnsupportedMoEError(NotAMoEModelError):
    """The model is a mixture of experts, but its experts cannot be offloaded or traced as they are."""


@dataclass
class MoELayer:
    """One MoE block of a model, in forward order."""

    index: int  # position among the model's MoE blocks, 0..L-1
    name: str  # module path of the block, e.g. "model.layers.3.mlp"
    block: nn.Module
    router: nn.Module
    experts: nn.Module  # block.experts
    adapter: "ArchAdapter"
    num_experts: int  # experts that hold weights
    num_choices: int  # what the router chooses among: the experts and weightless ones (LongCat's zero experts)
    top_k: int
    logits_index: int | None  # which output of the router holds its logits (None: the output is the logits)


class ArchAdapter:
    """How one convention of calling experts is read. Subclasses hold only what differs."""

    name: ClassVar[str]

    def matches(self, block: nn.Module, experts: nn.Module) -> bool:
        raise NotImplementedError

    def routing(self, layer: MoELayer, router_output) -> tuple[torch.Tensor, torch.Tensor]:
        """Router output → (logits [..., E] float32 over the weight-holding experts, selected ids
        [..., k]): the logits are the output transformers records as `router_logits`; the ids are
        the router's integer output of width k where it has one, else the top-k of the logits."""
        outputs = router_output if isinstance(router_output, (tuple, list)) else (router_output,)
        logits = outputs[layer.logits_index or 0]
        selected = next((t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()
                         and t.shape[-1] == layer.top_k and t.shape[:-1] == logits.shape[:-1]), None)
        if selected is None:
            selected = logits.topk(layer.top_k, dim=-1).indices
        return logits[..., :layer.num_experts].float(), selected

    def expert_param_names(self, layer: MoELayer) -> list[str]:
        """Names (relative to the experts module) of the tensors that hold routed experts."""
        return [name for name, _ in layer.experts.named_parameters()]


def _positional(method) -> int:
    """How many positional arguments a bound method takes."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(method).parameters.values())


class FusedExpertsAdapter(ArchAdapter):
    """Experts called with the router's choice as ids: `experts(hidden_states, top_k_index,
    top_k_weights)`, holding [E, ...] tensors (or, as DBRX, [E * rows, ...])."""

    name = "fused"

    def matches(self, block, experts):
        return _positional(experts.forward) == 3 and not _per_expert_modules(experts)


class DenseExpertsAdapter(ArchAdapter):
    """Experts called on every (expert, token) row: `experts(hidden_states [E * N, H])`, each
    row scaled by the token's router score for that expert, which is zero where it was not
    chosen (Llama 4). Without biases an expert maps a zero row to zero."""

    name = "dense"

    def matches(self, block, experts):
        return _positional(experts.forward) == 1 and not _per_expert_modules(experts)


class SwitchAdapter(ArchAdapter):
    """Switch Transformers: top-1 router returning (dispatch one-hot, probs, logits); one
    `expert_{i}` submodule per expert, called with the one-hot dispatch mask."""

    name = "switch"

    def matches(self, block, experts):
        return type(block).__name__ == "SwitchTransformersSparseMLP"


def _per_expert_modules(experts: nn.Module) -> bool:
    return isinstance(experts, nn.ModuleDict) or any(name.startswith("expert_") for name, _ in experts.named_children())


ADAPTERS: dict[str, ArchAdapter] = {a.name: a for a in (FusedExpertsAdapter(), DenseExpertsAdapter(), SwitchAdapter())}

# experts class → why it cannot be offloaded as it is
REFUSALS: dict[str, str] = {
    "NllbMoeExperts": "transformers' NllbMoeExperts one-hot-encodes the router's one-hot mask, so experts 0 and 1 "
                      "run for every token whatever the router chose; traces and offloading would follow a router "
                      "the model ignores",
}
# MoE block class → why it cannot be offloaded (blocks without an `experts` module)
BLOCK_REFUSALS: dict[str, str] = {
    "DogeCDMoE": "Doge's experts are single rows of two embedding tables that its block reads by product-key "
                 "lookup, not an experts module called with expert ids; they stay resident with the block",
}
BLOCK_REFUSALS["JetMoeMoE"] = BLOCK_REFUSALS["JetMoeMoA"] = (
    "JetMoE's experts are two JetMoeParallelExperts (input_linear, output_linear) fed tokens sorted by expert, in "
    "its MLP and in its attention (MoA); no adapter reads that layout yet")


def router_recorders(model: nn.Module) -> dict[type, int | None]:
    """Router class → index of its output that transformers records as `router_logits`."""
    found: dict[type, int | None] = {}
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is None:
            continue
        target = getattr(recorder, "target_class", recorder)
        found[target] = getattr(recorder, "index", None)
    return found


def _first_int(objects: tuple, attrs: tuple[str, ...]) -> int | None:
    for obj in objects:
        for attr in attrs:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{getattr(config, 'model_type', None) or type(model).__name__} ({type(model).__name__})"


def _layer(model: nn.Module, index: int, name: str, block: nn.Module, router: nn.Module,
           logits_index: int | None) -> MoELayer:
    family = _family(model)
    experts = getattr(block, "experts", None)
    if type(block).__name__ in BLOCK_REFUSALS or not isinstance(experts, nn.Module):
        reason = BLOCK_REFUSALS.get(type(block).__name__, f"{type(block).__name__} has no experts module")
        raise UnsupportedMoEError(f"{family}: not supported: {reason}.")
    if type(experts).__name__ in REFUSALS:
        raise UnsupportedMoEError(f"{family}: not supported: {REFUSALS[type(experts).__name__]}.")
    adapter = next((a for a in ADAPTERS.values() if a.matches(block, experts)), None)
    if adapter is None:
        raise UnsupportedMoEError(f"{family}: not supported: {type(experts).__name__}.forward takes "
                                  f"{_positional(experts.forward)} arguments, a convention no adapter reads "
                                  f"({', '.join(ADAPTERS)}).")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = _first_int((experts,), _COUNT_ATTRS) or len(list(experts.children()))
    top_k = 1 if adapter.name == "switch" else _first_int((router, block, experts, config), _TOP_K_ATTRS)
    choices = _router_width(router) or count
    if top_k is None:
        raise UnsupportedMoEError(f"{family}: not supported: no top-k found on {type(router).__name__}, "
                                  f"{type(block).__name__} or the config.")
    return MoELayer(index, name, block, router, experts, adapter, count, max(choices, count), top_k, logits_index)


def _router_width(router: nn.Module) -> int | None:
    """How many choices the router scores: the output size of its (last) linear map."""
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1].out_features
    weight = getattr(router, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """All MoE blocks of `model` in forward order (for encoder-decoders: encoder first)."""
    recorders = router_recorders(model)
    modules = dict(model.named_modules())
    layers: list[MoELayer] = []
    for name, module in modules.items():
        cls = next((c for c in recorders if isinstance(module, c)), None)
        if cls is None:
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        block_name, block = (name, module) if cls.__name__ in BLOCK_REFUSALS else (parent, modules[parent])
        layers.append(_layer(model, len(layers), block_name, block, module, recorders[cls]))
    if not layers:
        raise NotAMoEModelError(
            f"{type(model).__name__} has no mixture-of-experts block; expected a transformers MoE model (one "
            f"that records `router_logits`) whose experts are called in one of these ways: {', '.join(ADAPTERS)} "
            "(Mixtral, Qwen2/3-MoE, DeepSeek, Llama 4, Gemma 4, GPT-OSS, Switch Transformers, ...)."
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
