"""`RuntimeOptions`: every runtime setting checked where it enters, recorded whole in results."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cache.timing import LinkTiming
from offload_runtime.engine.generate import GenerationError, Sampling, generate_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from offload_runtime.engine.resolve import options_for
from predictor.base import PredictorError
from prescient.budget import Budget
from prescient.errors import CapacityError, PrescientError
from prescient.loading import load_model, load_tokenizer


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"transfer_workers": 0}, OptionsError, r"transfer_workers must be at least 1, got 0"),
    ({"transfer_workers": 1.5}, OptionsError, r"transfer_workers must be a whole number, got 1.5"),
    ({"transfer_workers": True}, OptionsError, r"transfer_workers must be a whole number"),
    ({"prefetch_per_layer": -2}, OptionsError, r"prefetch_per_layer must be at least 0, got -2"),
    ({"store": "tape"}, OptionsError, r"store must be one of disk, host, got 'tape'"),
    ({"dtype": "float16"}, OptionsError, r"dtype must be one of float32, bfloat16, got 'float16'"),
    ({"drop_page_cache": "yes"}, OptionsError, r"drop_page_cache must be True or False"),
    ({"link_timing": {"layer_compute_s": 1.0}}, OptionsError, r"link_timing must be a cache.timing.LinkTiming"),
    ({"next_token_min_chance": 1.5}, PredictorError, r"must be in \[0, 1\], got 1.5"),
    ({"next_token_min_chance": "0.5"}, PredictorError, r"must be in \[0, 1\]"),
    ({"budget": 48}, CapacityError, r"neither a fraction"),
    ({"budget": "48"}, CapacityError, r"names no unit"),
    ({"policy": "belady"}, PrescientError, r"'belady' cannot serve"),
    ({"policy": 3}, OptionsError, r"policy must be a policy name"),
    ({"device": "tpu"}, PrescientError, r"device 'tpu'"),
])
def test_a_bad_option_is_refused_when_made(fields, error, message):
    with pytest.raises(error, match=message):
        RuntimeOptions(**fields)


def test_options_are_normalised_frozen_and_recorded_whole():
    link = LinkTiming(1.0, 100.0, 1000.0)
    options = RuntimeOptions(policy="MRS", budget="50%", link_timing=link, next_token_min_chance=1)
    assert options.policy == "mrs" and options.budget == Budget(0.5, "fraction")
    assert options.next_token_min_chance == 1.0 and options.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.policy = "lru"
    record = options.to_json()
    assert set(record) == RuntimeOptions.names() and json.loads(json.dumps(record)) == record
    assert record["budget"] == 0.5 and record["link_timing"] == link.to_dict()


def test_options_come_whole_or_as_keywords_never_both(tiny_moe_dir):
    model_dir = tiny_moe_dir("mixtral")
    options = RuntimeOptions(budget=0.25)
    assert options_for(model_dir, None, options, {}) is options
    assert options_for(model_dir, None, None, {"budget": 0.25}) == options
    with pytest.raises(TypeError, match="not both"):
        options_for(model_dir, None, options, {"policy": "lfu"})


def test_generate_records_every_option(tiny_moe_dir):
    options = RuntimeOptions(policy="fifo", budget="6slots", transfer_workers=2)
    record = generate_offloaded(tiny_moe_dir("mixtral"), "def f(x):", 2, options=options)
    assert {k: record["settings"][k] for k in RuntimeOptions.names()} == options.to_json()


def test_seeded_sampling_through_the_runtime_draws_the_plain_models_tokens(tiny_moe_dir):
    """Offloading computes the same logits, so the same seed samples the same tokens; the record says how it decoded."""
    path = tiny_moe_dir("mixtral")
    sampling = Sampling(seed=3, temperature=0.7, top_p=0.9)
    record = generate_offloaded(path, "def f(x):", 12, sampling=sampling, budget="25%")
    model = load_model(path, dtype=torch.float32)[0]
    ids = load_tokenizer(path)("def f(x):", return_tensors="pt").input_ids
    torch.manual_seed(3)
    with torch.inference_mode():
        plain = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9,
                               pad_token_id=model.config.pad_token_id)
    assert record["token_ids"] == plain[0, ids.shape[1]:].tolist()
    assert record["settings"]["decoding"] == {"sampled": {"seed": 3, "temperature": 0.7, "top_p": 0.9}}
    assert generate_offloaded(path, "def f(x):", 2)["settings"]["decoding"] == "greedy"
    with pytest.raises(GenerationError, match="temperature 0 is not a positive number"):
        Sampling(seed=0, temperature=0)
    with pytest.raises(GenerationError, match=r"top_p 1.5 is not in \(0, 1\]"):
        Sampling(seed=0, top_p=1.5)
