import pytest
import torch
from transformers import MixtralForCausalLM

from predictor import GateLookahead, PredictorError, recall_at
from prescient.arch import find_moe_layers


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return MixtralForCausalLM.from_pretrained(tiny_model_dir).eval()


def true_routing(model, input_ids):
    """[B, T, L, k] experts the routers chose, and the MoE blocks' inputs, per layer."""
    chosen, inputs, handles = {}, {}, []
    for layer in find_moe_layers(model):
        def keep(module, args, output, i=layer.index, layer=layer):
            chosen[i] = layer.adapter.routing(layer, output)[1]
        handles.append(layer.router.register_forward_hook(keep))
        handles.append(layer.block.register_forward_pre_hook(lambda m, a, i=layer.index: inputs.__setitem__(i, a[0])))
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    b, t = input_ids.shape
    return torch.stack([chosen[i].view(b, t, -1) for i in sorted(chosen)], dim=2), inputs


def test_lookahead_is_the_next_router_on_the_current_input(model):
    pred = GateLookahead(model)
    ids = torch.randint(0, 40, (2, 9))
    topk, inputs = true_routing(model, ids)
    seen = {}
    pred.attach(seen.__setitem__)
    with torch.no_grad():
        model(ids)
    pred.detach(seen.__setitem__)
    assert sorted(seen) == [0, 1, 2]
    layers = find_moe_layers(model)
    expected = torch.nn.functional.linear(inputs[0], layers[1].router.weight)
    torch.testing.assert_close(seen[1], expected)
    assert recall_at(seen[0][:, :, None], topk[:, :, :1], 2) == 1.0  # layer 0: its own router
    assert not any(layer.block._forward_pre_hooks for layer in layers), "detach removes the hooks"


def test_predict_and_step_run_the_model(model):
    pred = GateLookahead(model)
    ids = torch.randint(0, 40, (2, 6))
    scores = pred.predict(ids)
    assert scores.shape == (2, 6, 3, 8)
    state = pred.start(2)
    steps = torch.stack([pred.step(state, ids[:, t]) for t in range(6)], dim=1)
    torch.testing.assert_close(steps, scores, atol=1e-4, rtol=1e-4)
    with pytest.raises(PredictorError, match="no next MoE layer"):
        pred.lookahead(2, torch.zeros(1, 32))
