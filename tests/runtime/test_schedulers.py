"""The decode loop's schedulers: in-token lookahead (HybriMoE) guesses the next layers' experts
from a block's input with their own routers, and issues them once the block's experts are
pinned; each mechanism is a `RuntimeOptions` field and a bench run mode."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.bench_runtime.grid import BenchError, RunSpec, parse_runs
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from cli.main import main
from prescient.loading import load_tokenizer
from tests.conftest import random_sida

PROMPT = "def f(x):\n    return x + 1"


def test_lookahead_guesses_the_next_layers_with_their_own_routers(tiny_tokenizer, tmp_path):
    from prescient.arch_zoo import save_tiny_model
    from tests.conftest import tiny_test_config

    config = tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=4)
    path = save_tiny_model(config, tmp_path / "mixtral-4", seed=5, tokenizer=tiny_tokenizer)
    model = load_offloaded(path, budget=0.5, lookahead_layers=2)
    with model.runtime as runtime:
        look, layers = runtime.lookahead, runtime.layers
        hidden = torch.randn(1, 3, config.hidden_size)
        keys = look.keys(1, hidden)
        for target in (2, 3):  # nearest layer first; each token's top-2 under that layer's own router
            with torch.no_grad():
                probs = torch.softmax(layers[target].router(hidden.reshape(-1, config.hidden_size))[0], -1)
            want = set(torch.topk(probs, 2, dim=-1).indices.flatten().tolist())
            assert {e for layer, e in keys if layer == target} == want
        assert [layer for layer, _ in keys] == sorted(layer for layer, _ in keys)
        assert {layer for layer, _ in look.keys(3, hidden)} == set()  # the stack's last layer: nothing ahead
        assert {layer for layer, _ in look.keys(2, hidden)} == {3}
        ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=model.config.pad_token_id)
        stats = runtime.stats()
        assert stats.lookahead_prefetches > 0 and stats.prefetch_inserts >= stats.lookahead_prefetches


def test_scheduler_options_are_checked_and_recorded():
    assert RuntimeOptions().expert_pipeline and RuntimeOptions().lookahead_layers == 0
    options = RuntimeOptions(expert_pipeline=False, lookahead_layers=3)
    assert options.to_json()["expert_pipeline"] is False and options.to_json()["lookahead_layers"] == 3
    with pytest.raises(OptionsError, match="lookahead_layers must be 0 .* to 3"):
        RuntimeOptions(lookahead_layers=4)
    with pytest.raises(OptionsError, match="expert_pipeline must be True or False"):
        RuntimeOptions(expert_pipeline="yes")


def test_bench_run_modes_switch_the_schedulers():
    runs = parse_runs("none:lru@0.5+serial, none:lru@0.5+look, sida:mrs@0.25+look+next")
    assert runs == [RunSpec("none", "lru", 0.5, ("serial",)), RunSpec("none", "lru", 0.5, ("look",)),
                    RunSpec("sida", "mrs", 0.25, ("next", "look"))]
    assert runs[2].label == "sida+mrs@0.25+next+look"
    with pytest.raises(BenchError, match="prefetch modes need a predictor"):
        parse_runs("none:lru@0.5+next")


@pytest.mark.parametrize(("horizon", "want"), [(0, "lru"), (2, "learned-belady")])
def test_without_a_policy_named_the_best_measured_one_serves(tiny_moe_dir, tmp_path, horizon, want):
    """`generate --predictor P` with no --policy: learned-belady when P has forecast heads, else
    LRU; plain LRU stays one flag away."""
    model = tiny_moe_dir("mixtral")
    predictor = random_sida(model, tmp_path, horizon=horizon)
    record = main_json(["generate", "--model", str(model), "--predictor", str(predictor), "--prompt", PROMPT,
                        "--max-new-tokens", "2"], tmp_path)
    assert record["settings"]["policy"] == want
    named = main_json(["generate", "--model", str(model), "--predictor", str(predictor), "--policy", "lru",
                       "--prompt", PROMPT, "--max-new-tokens", "2"], tmp_path)
    assert named["settings"]["policy"] == "lru"


def main_json(argv: list[str], tmp_path) -> dict:
    out = tmp_path / "out.json"
    out.unlink(missing_ok=True)
    main([*argv, "--json", str(out)])
    return json.loads(out.read_text())


def test_a_trained_probe_can_guess_for_the_lookahead(tiny_moe_dir, tmp_path):
    """--lookahead-probe: the probe's guesses are what gets prefetched, outputs stay exact; a probe
    of fewer layers ahead than asked, or another predictor kind, is refused in one line."""
    from predictor.artifact import load_predictor
    from predictor.base import PredictorError
    from tests.predictor.probes import random_probe

    path = tiny_moe_dir("mixtral")
    probe_path = random_probe(path, tmp_path / "probe", ahead=1)
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    plain = load_offloaded(path, budget=1.0)
    model = load_offloaded(path, budget=0.25, lookahead_layers=1, lookahead_probe=str(probe_path))
    with plain.runtime, model.runtime as runtime, torch.inference_mode():
        hidden = torch.randn(1, 2, model.config.hidden_size)
        probe = load_predictor(probe_path)
        want = torch.topk(torch.softmax(probe.lookahead(0, hidden.reshape(-1, hidden.shape[-1])), -1), 2).indices
        assert {e for _, e in runtime.lookahead.keys(0, hidden)} == set(want.flatten().tolist())
        settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": model.config.pad_token_id}
        assert torch.equal(model.generate(ids, **settings), plain.generate(ids, **settings))
        assert runtime.stats().lookahead_prefetches > 0
    with pytest.raises(PredictorError, match="looks 1 layer\\(s\\) ahead, not 2"):
        load_offloaded(path, budget=0.5, lookahead_layers=2, lookahead_probe=str(probe_path))
    with pytest.raises(PredictorError, match="not a lookahead probe"):
        load_offloaded(path, budget=0.5, lookahead_layers=1, lookahead_probe=str(random_sida(path, tmp_path)))
    with pytest.raises(OptionsError, match="give lookahead_layers 1 to 3"):
        RuntimeOptions(lookahead_probe=str(probe_path))


def test_an_evicted_expert_has_not_landed(tiny_moe_dir):
    """Its last copy finished, but it has no slot: the layer must take the pipelined path."""
    model = load_offloaded(tiny_moe_dir("mixtral"), policy="lru", budget="2slots")
    with model.runtime as runtime:
        cpu = torch.device("cpu")
        assert sorted(e for part, _ in runtime.arriving(0, [0, 1], cpu) for e in part) == [0, 1]  # as they land
        assert runtime._all_landed(0, [0, 1])
        list(runtime.arriving(0, [2, 3], cpu))  # evicts 0 and 1
        assert runtime.engine.ready((0, 0)) and not runtime._all_landed(0, [0])


@pytest.mark.parametrize("pipeline", [True, False])
def test_generate_computes_misses_as_they_land_only_with_the_pipeline(tiny_moe_dir, pipeline):
    """Decoding with misses: with the expert pipeline every decode step's layer that misses has its
    experts computed as they land (made resident without waiting for the copies); without it, none
    does (one wait)."""
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, policy="lru", budget="3slots", expert_pipeline=pipeline)
    with model.runtime as runtime:
        use = runtime._use
        missing, pipelined = [], []

        def recorded_use(layer, experts, device, wait=True):
            if runtime.step > 0:  # a decode step's layer (forward 0 is the prompt's)
                missing.append(any(runtime.pool.map.slot_of((layer, e)) is None for e in experts))
                if not wait:
                    pipelined.append(layer)
            return use(layer, experts, device, wait)

        runtime._use = recorded_use
        ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=model.config.pad_token_id)
    assert sum(missing) > 0
    assert len(pipelined) == (sum(missing) if pipeline else 0)
