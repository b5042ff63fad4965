"""`prescient tune`: it measures each mechanism against the best so far at each memory size, keeps
the best per model and machine, and `--memory` runs that unless a flag names otherwise."""

from __future__ import annotations

import argparse
import logging

import pytest

from cli import args as cli_args
from cli.main import main
from offload_runtime.engine import loader
from offload_runtime.engine.memory_plan import MiB, reserve_bytes
from offload_runtime.engine import tuned as tuned_module
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.tuned import load_tuned, save_tuned
from offload_runtime.planning import tune as tune_module
from prescient.capped_run import cgroup_kind
from prescient.errors import CapacityError
from prescient.model_dir import ModelDirectory

FOOTPRINT = 400 * MiB


@pytest.fixture
def tuned_home(tmp_path, monkeypatch, caplog):
    """A tuned-file folder of the test's own; the tuned module's one-line messages captured (an
    earlier test's logging configuration may have disabled its logger)."""
    monkeypatch.setenv("PRESCIENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuned_module.log, "disabled", False)
    caplog.set_level(logging.INFO, logger=tuned_module.log.name)
    return tmp_path / "cache"


def _sizes(path, monkeypatch) -> list[int]:
    """Two caps that buy 4 and 8 slots of the tiny model, with the footprint held fixed."""
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    directory = ModelDirectory.open(path)
    config = directory.config
    expert_bytes = 3 * config.hidden_size * config.intermediate_size * 4  # gate, up and down in float32
    reserve = reserve_bytes(directory.config, 4, 4 * expert_bytes)  # room for up to 4 transfer workers
    return [FOOTPRINT + reserve + 4 * expert_bytes, FOOTPRINT + reserve + 8 * expert_bytes]


def test_tune_keeps_the_fastest_measured_settings_per_size(tiny_moe_dir, tuned_home, monkeypatch):
    path = tiny_moe_dir("mixtral")
    sizes = _sizes(path, monkeypatch)
    speeds = iter(range(1000))  # every later run faster: each change is kept, in order

    def fake_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
        speed = float(next(speeds))
        return {"tokens_per_s": [speed] * len(prompts), "stats": {}, "memory_plan": None}

    record = tune_module.tune(path, memories=sizes, new_tokens=4, repeats=1, prompts=["def f(x):", "import os"],
                              decode=fake_decode)
    assert [best["memory"] for best in record["best"]] == sizes
    for best in record["best"]:
        assert best["kept"] == [name for name, _ in tune_module.candidate_changes(record["read_curve"]["depth"],
                                                                                   False)]
        assert best["settings"]["lookahead_layers"] == 1 and best["settings"]["expert_pipeline"] is False
    saved = save_tuned(path, record)
    assert saved.parent.parent == tuned_home and load_tuned(path).settings_for(sizes[1] + 1) == \
        record["best"][1]["settings"]


@pytest.mark.slow  # 14 s: three fresh capped processes; the default suite ran 639 s on a fresh clone
def test_one_calibration_decode_runs_in_a_process_of_its_own_under_the_cap(tiny_moe_dir):
    """As `tune` runs each configuration: a fresh process, in a cgroup capped at the size where
    this machine has one (the tiny model is mapped whole at 2 GiB); a cap too small for the process
    kills it there (it scores 0), and is refused uncapped."""
    path = str(tiny_moe_dir("mixtral"))
    capped = cgroup_kind() != "none"
    decode = tune_module.decode_capped if capped else tune_module.decode_in_child
    prompts = ["def f(x):", "import os"]
    result = decode(path, prompts, 4, None, RuntimeOptions(memory=2 * 2**30))
    assert len(result["tokens_per_s"]) == 2 and min(result["tokens_per_s"]) > 0 and result["memory_plan"]["mapped"]
    assert decode(path, prompts, 4, None, RuntimeOptions(memory=2 * 2**30), timeout_s=0.01)["tokens_per_s"] == [0.0, 0.0]
    if capped:
        assert decode(path, prompts, 4, None, RuntimeOptions(memory=64 * MiB))["killed"]
    else:
        with pytest.raises(CapacityError, match="smallest memory that works"):
            decode(path, prompts, 4, None, RuntimeOptions(memory=64 * MiB))


@pytest.mark.slow
def test_tune_runs_real_decodes_and_memory_then_uses_them_unless_a_flag_says(tiny_moe_dir, tuned_home, caplog,
                                                                              capsys):
    """Each decode in a process of its own, as `prescient tune` runs them (2 GiB holds the tiny
    model whole: the mechanisms then change nothing, but the flow is the real one; ~2.5 minutes)."""
    path = tiny_moe_dir("mixtral")
    sizes = [2 * 2**30]
    assert main(["tune", "--model", str(path), "--memory", "2GiB", "--new-tokens", "4", "--repeats", "1"]) in (0, None)
    printed = capsys.readouterr().out
    assert "kept as this machine's default" in printed and "tokens/s" in printed
    tuned = load_tuned(path).settings_for(sizes[0])

    parser = argparse.ArgumentParser()
    cli_args.add_runtime_args(parser)
    parser.add_argument("--model")
    with caplog.at_level(logging.INFO):
        options = cli_args.runtime_options(parser.parse_args(["--model", str(path), "--memory", f"{sizes[0]}B"]))
    assert "tuned on this machine" in caplog.text
    assert {k: getattr(options, k) for k in tuned} == tuned
    other = 1 if tuned["lookahead_layers"] == 0 else 0
    named = cli_args.runtime_options(parser.parse_args(["--model", str(path), "--memory", f"{sizes[0]}B",
                                                        "--lookahead", str(other)]))
    assert named.lookahead_layers == other  # a flag named wins over the tuned setting


def test_without_tuning_memory_says_how_to_tune_in_one_line(tiny_moe_dir, tuned_home, caplog):
    path = tiny_moe_dir("mixtral")
    parser = argparse.ArgumentParser()
    cli_args.add_runtime_args(parser)
    parser.add_argument("--model")
    with caplog.at_level(logging.INFO):
        options = cli_args.runtime_options(parser.parse_args(["--model", str(path), "--memory", "1GiB"]))
    assert f"prescient tune --model {path}" in caplog.text
    assert (options.transfer_workers, options.lookahead_layers, options.expert_pipeline) == (1, 0, True)


def test_a_change_twice_as_fast_on_one_prompt_and_half_on_another_is_not_kept(tiny_moe_dir, tuned_home, monkeypatch):
    """The paired statistic: a change twice as fast on one prompt and half as fast on the other is
    no gain (one prompt is not a workload: LRU's win on one prompt halved another's speed on runs/tb)."""
    path = tiny_moe_dir("mixtral")
    sizes = _sizes(path, monkeypatch)[:1]

    def fake_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
        speeds = [20.0, 5.0] if options.policy == "lru" else [10.0, 10.0]  # geometric mean of ratios: 1
        return {"tokens_per_s": speeds, "stats": {}, "memory_plan": None}

    monkeypatch.setattr(tune_module, "best_policy", lambda predictor: "learned-belady")
    record = tune_module.tune(path, "predictor", memories=sizes, new_tokens=4, repeats=2,
                              prompts=["def f(x):", "import os"], decode=fake_decode)
    (best,) = record["best"]
    assert "policy lru" not in best["kept"] and best["settings"]["policy"] == "learned-belady"
    assert best["tokens_per_s"] == 10.0


def test_a_change_that_wins_beyond_the_spread_is_kept_though_it_loses_a_little_on_one_prompt(
        tiny_moe_dir, tuned_home, monkeypatch):
    """1.5x on two prompts, 0.95x on a third, against a best whose runs vary by 10%: kept (the rule
    before, a win on every prompt, kept nothing at this machine's spread)."""
    path = tiny_moe_dir("mixtral")
    sizes = _sizes(path, monkeypatch)[:1]
    calls = []

    def fake_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
        calls.append(options.policy)
        noise = 1.1 if len(calls) % 4 == 1 else 1.0  # the best's runs spread by 10%
        speeds = [15.0, 15.0, 9.5] if options.policy == "lru" else [10.0 * noise, 10.0, 10.0]
        return {"tokens_per_s": speeds, "stats": {}, "memory_plan": None}

    monkeypatch.setattr(tune_module, "best_policy", lambda predictor: "learned-belady")
    record = tune_module.tune(path, "predictor", memories=sizes, new_tokens=4, repeats=2,
                              prompts=["def f(x):", "import os", "class A:"], decode=fake_decode)
    (best,) = record["best"]
    assert "policy lru" in best["kept"] and best["settings"]["policy"] == "lru"


def test_a_tune_at_another_size_keeps_the_sizes_tuned_before(tiny_moe_dir, tuned_home):
    path = tiny_moe_dir("mixtral")
    settings = tune_module.starting_settings(None)
    save_tuned(path, {"best": [{"memory": 4 * 2**30, "settings": {**settings, "read_depth": 4}}]})
    save_tuned(path, {"best": [{"memory": 6 * 2**30, "settings": {**settings, "read_depth": 8}}]})
    save_tuned(path, {"best": [{"memory": 6 * 2**30, "settings": {**settings, "read_depth": 16}}]})
    tuned = load_tuned(path)
    assert sorted(tuned.best) == [4 * 2**30, 6 * 2**30]
    assert tuned.settings_for(4 * 2**30)["read_depth"] == 4 and tuned.settings_for(6 * 2**30)["read_depth"] == 16


def test_a_run_far_slower_than_the_fastest_at_its_size_is_stopped_and_scores_zero(tiny_moe_dir, tuned_home,
                                                                                   monkeypatch):
    """The first run at a size may take RUN_TIMEOUT_S; later ones SLOWER_LIMIT times the fastest
    (at least MIN_LIMIT_S): a candidate that would run for minutes is stopped and not kept."""
    path = tiny_moe_dir("mixtral")
    limits = []

    def fake_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
        limits.append(timeout_s)
        if not options.expert_pipeline:  # serial layers: past its limit
            return {"tokens_per_s": [0.0] * len(prompts), "stats": {}, "memory_plan": None, "timed_out": True}
        return {"tokens_per_s": [10.0] * len(prompts), "stats": {}, "memory_plan": None, "seconds": 30.0}

    record = tune_module.tune(path, memories=_sizes(path, monkeypatch)[:1], new_tokens=4, repeats=1,
                              prompts=["def f(x):"], decode=fake_decode)
    assert limits[0] == tune_module.RUN_TIMEOUT_S
    assert set(limits[1:]) == {max(tune_module.MIN_LIMIT_S, tune_module.SLOWER_LIMIT * 30.0)}
    assert "serial layers" not in record["best"][0]["kept"]
    assert any(run["timed_out"] for run in record["runs"])


def test_tune_can_choose_the_runtime_without_its_predictor(tiny_moe_dir, tuned_home, monkeypatch, tmp_path):
    """Where the runtime without the predictor measured faster, tune keeps it, and `--memory` with that
    predictor then runs without it: not loaded, LRU."""
    from offload_runtime.engine.loader import load_offloaded
    from offload_runtime.engine.resolve import LoadRequest, resolve_options
    from tests.runtime.test_offloaded_generate import save_tiny_predictor

    path = tiny_moe_dir("mixtral")
    size = _sizes(path, monkeypatch)[1]
    predictor = save_tiny_predictor("frequency", path, tmp_path)

    def fake_decode(directory, prompts, new_tokens, given, options, timeout_s):
        return {"tokens_per_s": [20.0 if not options.use_predictor else 10.0] * len(prompts), "stats": {},
                "memory_plan": None}

    record = tune_module.tune(path, predictor, memories=[size], new_tokens=4, repeats=1, prompts=["def f(x):"],
                              decode=fake_decode)
    (best,) = record["best"]
    assert best["kept"] == ["no predictor"] and best["settings"]["use_predictor"] is False
    save_tuned(path, record)
    options = resolve_options(path, predictor, {"memory": size})
    assert options.use_predictor is False and options.policy == "lru"
    assert resolve_options(path, predictor, {"memory": size, "use_predictor": True}).use_predictor  # named wins
    assert LoadRequest(path, predictor, options).resolved().predictor is None  # the one resolver drops it
    with load_offloaded(path, predictor, options).runtime as runtime:
        assert runtime.builder is None
