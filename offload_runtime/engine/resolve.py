"""The one resolver of a run's settings: (model directory, predictor, the settings a user named) ->
the `RuntimeOptions` the run uses. The command line (`cli.args.runtime_options`, which only turns
flags into values), the Python API (`load_offloaded`, `generate_offloaded`), `serve` (`create_app`)
and `bench --memory` all call `resolve_options`, so equal inputs give equal options wherever they
are named.

What a run uses, first found first:

1. what the user named (`overrides`: `RuntimeOptions` fields);
2. with a memory cap, what `prescient tune` measured best for this model on this machine nearest
   that cap (`tuned_settings`), less what needs forecasts where the predictor has no forecast heads
   (a learned policy, cross-token prefetch); where tune measured the runtime without the predictor
   faster (`use_predictor=False`), the predictor given is not loaded;
3. the policy that measured best with this predictor (`best_policy`);
4. the built-in defaults (`RuntimeOptions`' own).

A lookahead probe named without `lookahead_layers` looks one layer ahead.

What a run asks for travels as one value, a `LoadRequest` (vLLM's engine arguments, shared by its
`LLM(...)` and `vllm serve`, are the model): the command line builds it from its flags
(`cli.args.runtime_settings` turns them into values), the Python API from its arguments, and the
engine resolves it once (`LoadRequest.resolved`) where the model is loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cache import make_serving_policy
from offload_runtime.engine.memory_plan import Reserves
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.tuned import tuned_settings
from predictor.base import ExpertPredictor
from prescient.budget import parse_memory
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)

Predictor = str | os.PathLike | ExpertPredictor | None


def has_forecasts(predictor: Predictor) -> bool:
    """Whether `predictor` (an artifact path, a loaded predictor, or None) has forecast heads."""
    if predictor is None:
        return False
    if isinstance(predictor, ExpertPredictor):
        meta = predictor.meta
    else:
        from predictor.artifact import read_predictor_meta

        meta = read_predictor_meta(predictor)
    return int(meta.hparams.get("horizon", 0)) > 0


def best_policy(predictor: Predictor) -> str:
    """The serving policy that measured best with `predictor`: with forecast heads, learned-belady
    (with eight heads 1.33x on-demand LRU at 50% on the bench model, sampled decoding,
    results/bench-runtime-base-sampled.json, no other policy within its spread; with the demo's two,
    a median 1.06x no predictor at 0.66 GB, results/bench-prediction-tb-guard2.json); else LRU (no
    policy measured beyond LRU's spread there)."""
    return _best_policy(has_forecasts(predictor))


def _best_policy(forecasts: bool) -> str:
    """`best_policy` of a predictor with (`forecasts`) or without forecast heads."""
    return "learned-belady" if forecasts else "lru"


def resolve_options(model_dir: str | Path | ModelDirectory | None, predictor: Predictor = None,
                    overrides: Mapping[str, Any] | None = None) -> RuntimeOptions:
    """The `RuntimeOptions` of a run of `model_dir` with `predictor`: `overrides` (the fields a user
    named) over the tuned settings at their `memory`, the best measured policy and the defaults (see
    the module's docstring; `model_dir` is read only with a memory cap). Checked as `RuntimeOptions`
    checks every option."""
    named = dict(overrides or {})
    memory = named.get("memory")
    if isinstance(memory, str):
        memory = parse_memory(memory)
    tuned = tuned_settings(model_dir, memory) if memory is not None else {}
    # the predictor's meta read once; a run without the predictor (tune measured it faster) has no forecasts
    forecasts = {**tuned, **named}.get("use_predictor", True) is not False and has_forecasts(predictor)
    if tuned and not forecasts:
        tuned = _without_forecasts(tuned)
    settings = {"policy": _best_policy(forecasts), **tuned, **named}
    if settings.get("lookahead_probe") and not settings.get("lookahead_layers"):
        settings["lookahead_layers"] = 1  # a probe given is a probe used: one layer ahead unless named
    return RuntimeOptions(**settings)


def options_for(model_dir: str | Path | ModelDirectory, predictor: Predictor, options: RuntimeOptions | None,
                settings: Mapping[str, Any]) -> RuntimeOptions:
    """The Python API's options: `options` whole (already resolved), or `resolve_options` of the
    keyword `settings` (the fields a caller named)."""
    if options is None:
        return resolve_options(model_dir, predictor, settings)
    if settings:
        raise TypeError(f"give the runtime options whole or as keywords, not both ({', '.join(settings)})")
    return options


@dataclass(frozen=True)
class LoadRequest:
    """What a run asks to load: `model_dir`, `predictor` (an artifact path, a loaded predictor, or
    None), its options whole (`options`, used as they are) or the fields a user named (`settings`,
    resolved by `resolve_options`), and the `reserves` it keeps free under a memory cap (see
    `memory_plan.Reserves`)."""

    model_dir: str | Path | ModelDirectory
    predictor: Predictor = None
    options: RuntimeOptions | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    reserves: Reserves = Reserves()

    def resolved(self) -> LoadRequest:
        """This request with its options resolved (`options_for`): every option checked, before
        any file of the model is read; without its predictor where the options say not to use it
        (`use_predictor=False`, what tune keeps where the runtime without one measured faster)."""
        if self.options is not None and not self.settings and (self.predictor is None or self.options.use_predictor):
            return self  # resolved already
        options = options_for(self.model_dir, self.predictor, self.options, self.settings)
        predictor = self.predictor if options.use_predictor else None
        if self.predictor is not None and predictor is None:
            log.info("configuration: the runtime without the predictor (use_predictor=False)")
        return replace(self, options=options, settings={}, predictor=predictor)


def _without_forecasts(tuned: dict[str, Any]) -> dict[str, Any]:
    """The tuned settings a run without forecasts can use: a learned policy and cross-token prefetch
    (tuned with a predictor that has forecast heads) need them, so they fall back to the defaults."""
    learned = "policy" in tuned and make_serving_policy(str(tuned["policy"]), top_k=1).uses_forecasts
    dropped = {name for name, needs in (("policy", learned),
                                        ("next_token_min_chance", tuned.get("next_token_min_chance") is not None))
               if needs}
    if dropped:
        log.info("configuration: without a predictor's forecasts, %s from the defaults", " and ".join(sorted(dropped)))
    return {name: value for name, value in tuned.items() if name not in dropped}
