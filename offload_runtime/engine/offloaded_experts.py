"""The modules that replace a MoE block's experts: same forward signature, weights in slots.

Each keeps a *twin* of the model's own experts module whose parameters are views of the slot
pool's [S, ...] buffers, and remaps the router's expert ids to slot ids before calling that
twin's own forward — so transformers' expert math runs unchanged on the slot weights, and the
router stays the model's own. Which module replaces a block goes by its adapter's name:

- "fused" (`OffloadedExperts`): an experts module holding [E, ...] tensors, called as
  `experts(hidden_states, top_k_index, top_k_weights)`. The twin holds the [S, ...] buffers and
  gets slot ids for expert ids. The batched_mm/grouped_mm kernels sum a token's k expert
  outputs in router order, so their results are bit-identical to the resident model; eager
  accumulates in expert-id order, which the remap changes only for top-k > 2.
- "switch" (`OffloadedSwitchExperts`): Switch Transformers' `nn.ModuleDict` of `expert_{i}`
  modules, called as `experts(hidden_states, one_hot [N, 1, E], weights [N, 1])`. The twin holds
  S `expert_{s}` modules whose weights are slot s's views, and gets the one-hot over slots. A
  token has at most one expert, so the result is exact.

When a layer selects more experts than slots exist (a long prefill under a small budget), or the
runtime computes experts in arrival order (CGOPipe), the experts run in groups given by the
runtime's `parts`, each group on its own tokens, and the outputs are combined as the model
combines them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from prescient.arch import MoELayer

if TYPE_CHECKING:
    from offload_runtime.engine.runtime import OffloadRuntime


def twin(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` whose parameters named in `tensors` (dotted names, e.g.
    "wi.weight") are those tensors; submodules on their way are copied, all else is shared."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._parameters = {name: nn.Parameter(tensors[name], requires_grad=False) if name in tensors else param
                        for name, param in module._parameters.items()}
    below: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "." in name:
            child, rest = name.split(".", 1)
            below.setdefault(child, {})[rest] = tensor
    copy._modules = {name: twin(child, below[name]) if name in below else child
                     for name, child in module._modules.items()}
    return copy


class _Offloaded(nn.Module):
    """What both kinds share: the layer, the twin (not a submodule: no state_dict copy) and the
    runtime that makes experts resident."""

    def __init__(self, layer: MoELayer, expert_names: set[str], buffers: dict[str, torch.Tensor],
                 slot_twin: nn.Module, runtime: "OffloadRuntime") -> None:
        super().__init__()
        missing = expert_names - set(buffers)
        if missing:
            raise ValueError(f"slot pool lacks expert tensors {sorted(missing)} of layer {layer.index}")
        self.layer = layer.index
        self.num_experts = layer.num_experts
        object.__setattr__(self, "_twin", slot_twin)
        object.__setattr__(self, "_runtime", runtime)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"


class OffloadedExperts(_Offloaded):
    """Drop-in for a fused experts module: `forward(hidden_states, top_k_index, top_k_weights)`."""

    def __init__(self, layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: "OffloadRuntime") -> None:
        experts = layer.experts
        slot_twin = twin(experts, {name: buffers[name] for name in experts._parameters if name in buffers})
        slot_twin.num_experts = runtime.pool.num_slots
        super().__init__(layer, set(experts._parameters), buffers, slot_twin, runtime)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        experts = torch.unique(top_k_index).tolist()
        device = top_k_index.device
        if len(experts) <= self._runtime.pool.num_slots and not self._runtime.arrival_order:
            with self._runtime.use(self.layer, experts, device) as slots:
                return self._twin(hidden_states, slots[top_k_index], top_k_weights)
        # each group of experts runs on its own (token, choice) rows; then every token's k outputs
        # are summed in router order, as transformers' batched and grouped kernels sum them
        per_choice = hidden_states.new_zeros(*top_k_index.shape, hidden_states.shape[-1])
        for part, slots in self._runtime.parts(self.layer, experts, device):
            token, choice = torch.nonzero(torch.isin(top_k_index, torch.tensor(part, device=device)), as_tuple=True)
            per_choice[token, choice] = self._twin(
                hidden_states[token], slots[top_k_index[token, choice]].unsqueeze(1),
                top_k_weights[token, choice].unsqueeze(1))
        return per_choice.sum(dim=1).to(hidden_states.dtype)


class OffloadedSwitchExperts(_Offloaded):
    """Drop-in for Switch Transformers' experts: `forward(hidden_states, one_hot [N, 1, E], weights [N, 1])`."""

    def __init__(self, layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: "OffloadRuntime") -> None:
        experts = layer.experts
        template = next(iter(experts.children()))
        names = {name for name, _ in template.named_parameters()}
        num_slots = runtime.pool.num_slots
        slot_twin = object.__new__(type(experts))
        slot_twin.__dict__ = dict(experts.__dict__)
        slot_twin._modules = {f"expert_{s}": twin(template, {n: buffers[n][s] for n in names if n in buffers})
                              for s in range(num_slots)}
        slot_twin.num_experts = num_slots
        super().__init__(layer, names, buffers, slot_twin, runtime)

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor):
        chosen = selected_experts[:, 0, :]  # [N, E] one-hot; a zero row is a token over capacity
        routed = chosen.sum(-1) > 0
        expert_of = chosen.argmax(-1)
        out = torch.zeros_like(hidden_states)
        device = selected_experts.device
        for part, slots in self._runtime.parts(self.layer, torch.unique(expert_of[routed]).tolist(), device):
            rows = torch.nonzero(routed & torch.isin(expert_of, torch.tensor(part, device=device))).squeeze(1)
            one_hot = selected_experts.new_zeros(chosen.shape[0], 1, self._runtime.pool.num_slots)
            one_hot[rows, 0, slots[expert_of[rows]]] = 1
            out = out + self._twin(hidden_states, one_hot, routing_weights)  # parts own disjoint rows
        return out


OFFLOADED: dict[str, type[_Offloaded]] = {"fused": OffloadedExperts, "switch": OffloadedSwitchExperts}


def offload_experts(layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: "OffloadRuntime") -> nn.Module:
    """The module that replaces `layer.experts`, chosen by `layer.adapter.name`."""
    try:
        cls = OFFLOADED[layer.adapter.name]
    except KeyError:
        raise NotImplementedError(f"no offloaded experts module for {layer.adapter.name!r} blocks "
                                  f"({layer.name}); known kinds: {', '.join(OFFLOADED)}") from None
    return cls(layer, buffers, runtime)
