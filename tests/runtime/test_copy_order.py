"""A layer's demand copies start with the expert the most tokens routed to (HybriMoE's transfer
priority), on a real tiny model with real transfer threads."""

from __future__ import annotations

from collections import Counter

import torch

from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.offloaded_experts import most_routed_first
from offload_runtime.engine.options import RuntimeOptions
from prescient.loading import load_tokenizer

PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)  # the settings"


def test_most_routed_first_orders_by_load_then_id():
    assert most_routed_first(torch.tensor([[3, 1], [1, 2], [1, 3], [0, 2]])) == [1, 2, 3, 0]
    many = torch.tensor([5] * 200 + [2] * 100 + [7] * 100 + [0])  # over 256 ids: counted by torch
    assert most_routed_first(many) == [5, 2, 7, 0]


def test_demand_copies_start_with_the_most_loaded_expert(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, options=RuntimeOptions(budget="2slots"))
    runtime = model.runtime
    routed: list[Counter] = []  # per MoE layer call, the tokens routed to each expert
    requested: list[list[int]] = []  # per MoE layer call, its demand copies in request order

    def on_gate(_module, _inputs, out) -> None:
        routed.append(Counter(out[2].flatten().tolist()))
        requested.append([])

    hooks = [layer.mlp.gate.register_forward_hook(on_gate) for layer in model.model.layers]
    request = runtime.engine.request

    def recording(key, slot, priority=0.0, demand=False):
        if demand:
            requested[-1].append(key[1])
        return request(key, slot, priority=priority, demand=demand)

    runtime.engine.request = recording
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    with runtime, torch.inference_mode():
        model(ids)
    for hook in hooks:
        hook.remove()
    prompt_layers = [(loads, order) for loads, order in zip(routed, requested) if len(order) > 1]
    assert prompt_layers  # the prompt's layers miss more than one expert each under 2 slots
    for loads, order in prompt_layers:
        assert [loads[e] for e in order] == sorted((loads[e] for e in order), reverse=True), (loads, order)
        assert len({loads[e] for e in order}) > 1 or len(order) == 1  # the order is not vacuous
