"""The module that replaces a MoE block's experts: same forward signature, weights in slots.

For fused-experts blocks it keeps a twin of the model's own experts module whose parameters
are the slot pool's [S, ...] buffers, and remaps the router's expert ids to slot ids before
calling that module's own forward — so transformers' expert math (eager, batched_mm or
grouped_mm) runs unchanged on the slot weights, and the router stays the model's own.
The batched_mm/grouped_mm kernels sum a token's k expert outputs in router order, so their
results are bit-identical to the resident model; eager accumulates in expert-id order, which
the remap changes only for top-k > 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from offload_runtime.runtime import OffloadRuntime


def slot_twin(experts: nn.Module, buffers: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow twin of a fused experts module computing on the slot pool's buffers."""
    twin = object.__new__(type(experts))
    twin.__dict__ = dict(experts.__dict__)
    twin._parameters = {name: nn.Parameter(buffers[name], requires_grad=False) for name in experts._parameters}
    twin._buffers = dict(experts._buffers)
    twin._modules = dict(experts._modules)
    twin.num_experts = next(iter(buffers.values())).shape[0]
    return twin


class OffloadedExperts(nn.Module):
    """Drop-in for a fused experts module: `forward(hidden_states, top_k_index, top_k_weights)`."""

    def __init__(self, experts: nn.Module, layer: int, buffers: dict[str, torch.Tensor], runtime: "OffloadRuntime"):
        super().__init__()
        missing = set(experts._parameters) - set(buffers)
        if missing:
            raise ValueError(f"slot pool lacks expert tensors {sorted(missing)} of layer {layer}")
        self.layer = layer
        self.num_experts = experts.num_experts
        object.__setattr__(self, "_twin", slot_twin(experts, buffers))  # not a submodule: no state_dict copy
        object.__setattr__(self, "_runtime", runtime)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        experts = torch.unique(top_k_index).tolist()
        room = self._runtime.pool.num_slots
        if len(experts) > room:
            return self._forward_in_chunks(hidden_states, top_k_index, top_k_weights, experts, room)
        slots = self._runtime.acquire(self.layer, experts, top_k_index.device)
        try:
            return self._twin(hidden_states, slots[top_k_index], top_k_weights)
        finally:
            self._runtime.release(self.layer)

    def _forward_in_chunks(self, hidden_states, top_k_index, top_k_weights, experts: list[int], room: int):
        """More experts selected than slots exist (a long prefill under a small budget): each
        chunk of experts runs on its own (token, choice) rows, then every token's k outputs are
        summed in router order, as transformers' batched and grouped kernels sum them."""
        per_choice = hidden_states.new_zeros(*top_k_index.shape, hidden_states.shape[-1])
        for start in range(0, len(experts), room):
            part = experts[start : start + room]
            token, choice = torch.nonzero(torch.isin(top_k_index, torch.tensor(part, device=top_k_index.device)),
                                          as_tuple=True)
            slots = self._runtime.acquire(self.layer, part, top_k_index.device)
            try:
                per_choice[token, choice] = self._twin(
                    hidden_states[token], slots[top_k_index[token, choice]].unsqueeze(1),
                    top_k_weights[token, choice].unsqueeze(1))
            finally:
                self._runtime.release(self.layer)
        return per_choice.sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"
