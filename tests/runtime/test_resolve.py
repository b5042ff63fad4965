"""One resolver of a run's settings (`engine.resolve.resolve_options`): the command line and the
Python API give equal options for equal inputs, tuned settings and the best measured policy included,
and forecast settings are dropped where the predictor has no forecast heads."""

from __future__ import annotations

import json

import pytest

from cli.args import runtime_options, runtime_settings
from cli.main import build_parser
from offload_runtime.engine import tuned as tuned_module
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import LoadRequest, best_policy, resolve_options
from offload_runtime.engine.tuned import save_tuned
from tests.conftest import random_sida

TUNED = {"transfer_workers": 2, "read_depth": 4, "policy": "learned-belady", "next_token_min_chance": 0.5,
         "lookahead_layers": 1, "expert_pipeline": False, "map_experts": False,
         "use_predictor": True}


@pytest.fixture
def tuned_model(tiny_moe_dir, tmp_path, monkeypatch):
    """The tiny Mixtral, tuned at 1 GiB on this machine (in a tuned-file folder of the test's own)."""
    monkeypatch.setenv("PRESCIENT_CACHE", str(tmp_path / "cache"))
    model_dir = tiny_moe_dir("mixtral")
    save_tuned(model_dir, {"best": [{"memory": 2**30, "settings": TUNED}]})
    return model_dir


def cli_options(command: str, *argv: str) -> RuntimeOptions:
    """The options a command runs with: `runtime_options`, or (`generate`) its flags' values handed
    to the engine in a `LoadRequest`, resolved there; both the same."""
    parser, _ = build_parser(command)
    args = parser.parse_args([command, *argv])
    options = runtime_options(args)
    assert LoadRequest(args.model, args.predictor, settings=runtime_settings(args)).resolved().options == options
    return options


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("forecasts", [0, 2])
def test_the_cli_and_the_api_give_equal_options(tuned_model, tmp_path, command, forecasts):
    predictor = random_sida(tuned_model, tmp_path / "p", horizon=forecasts)
    extra = ["--prompt", "x"] if command == "generate" else []
    for argv, named in [([], {"memory": 2**30}),
                        (["--policy", "mrs", "--transfer-workers", "3"], {"memory": 2**30, "policy": "mrs",
                                                                          "transfer_workers": 3}),
                        (["--budget", "25%"], {"budget": "25%"})]:
        # the expert kernel named in both: its flag's default is the parser's own (cli/args.py)
        given = ["--model", str(tuned_model), "--predictor", str(predictor), "--expert-kernel", "model", *extra, *argv]
        if "budget" not in named:
            given += ["--memory", "1GiB"]
        assert cli_options(command, *given) == resolve_options(tuned_model, predictor,
                                                               {**named, "expert_kernel": "model"})


def test_tuned_settings_apply_and_forecast_settings_need_forecast_heads(tuned_model, tmp_path):
    with_heads = random_sida(tuned_model, tmp_path / "h", horizon=2)
    without = random_sida(tuned_model, tmp_path / "n", horizon=0)
    full = resolve_options(tuned_model, with_heads, {"memory": 2**30})
    assert {name: getattr(full, name) for name in TUNED} == TUNED
    for predictor in (without, None):
        options = resolve_options(tuned_model, predictor, {"memory": "1GiB"})
        assert options.policy == "lru" and options.next_token_min_chance is None  # dropped: no forecasts
        assert options.read_depth == 4 and options.transfer_workers == 2  # the rest still tuned


def test_without_memory_the_best_policy_and_the_defaults(tiny_moe_dir, tmp_path):
    model_dir = tiny_moe_dir("mixtral")
    with_heads = random_sida(model_dir, tmp_path / "h", horizon=2)
    assert best_policy(with_heads) == "learned-belady" and best_policy(None) == "lru"
    assert resolve_options(model_dir, with_heads) == RuntimeOptions(policy="learned-belady")
    assert resolve_options(model_dir, None, {"lookahead_probe": "p"}).lookahead_layers == 1
    assert json.dumps(resolve_options(model_dir).to_json())  # recorded whole
    assert tuned_module.TUNED_SETTINGS == tuple(TUNED)


def test_no_command_builds_its_runtime_options_itself():
    """`cli/` turns flags into values; the resolver alone makes the `RuntimeOptions` of a run."""
    from pathlib import Path

    import cli

    makers = [path.name for path in Path(cli.__file__).parent.glob("*.py") if "RuntimeOptions(" in path.read_text()]
    assert not makers, f"{makers} build RuntimeOptions from flags: call cli.args.runtime_options or resolve_options"
