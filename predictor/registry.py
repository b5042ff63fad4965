"""Predictor names as users write them, resolved in one place for every command.

A name is a built-in (`prescient.predictor_names`, by its short name or any alias), or a predictor artifact's path.
Built-ins are fit on a training trace (freq, token, corr), read the evaluated trace (oracle)
or run the live model (lookahead); artifacts are loaded and checked against the trace's model.
A hidden-state probe artifact runs the live model too (`needs_model`), bound to `--model`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from predictor.artifact import artifact_paths, load_predictor, read_predictor_meta
from predictor.base import ExpertPredictor, PredictorError, predictor_class
from predictor.baselines import FrequencyPredictor, OraclePredictor, TokenTablePredictor
from predictor.correlation import CorrelationTable
from predictor.lookahead import HiddenLookahead
from prescient.errors import PrescientError
from prescient.predictor_names import BUILTINS, NAMES_HELP, Builtin
from prescient.traces import Trace

_BY_NAME = {alias: b for b in BUILTINS for alias in (b.name, b.kind, *b.aliases)}
FITTED: dict[str, Callable[..., ExpertPredictor]] = {
    "freq": FrequencyPredictor.from_trace,
    "token": TokenTablePredictor.from_trace,
    "corr": CorrelationTable.from_trace,
}


class MissingPredictorInputError(PrescientError):
    """A built-in predictor needs a trace or a model that was not given."""


def builtin(name: str) -> Builtin | None:
    """The built-in a name or alias stands for (case-insensitive), else None."""
    return _BY_NAME.get(name.strip().lower())


def canonical_name(name: str) -> str:
    """A built-in's short name for any of its names; other names (artifacts) unchanged."""
    entry = builtin(name)
    return entry.name if entry is not None else name


def is_artifact(path: str | Path) -> bool:
    return artifact_paths(path)[1].exists()


def check_name(name: str, path: str | Path | None = None) -> None:
    """Refuse, before any work, a name that is neither a built-in nor (with or without `path`)
    a predictor artifact."""
    if path is None and builtin(name) is None and not is_artifact(name):
        raise PredictorError(f"unknown predictor {name!r}; known names: {NAMES_HELP}, or NAME=PATH for a "
                             "predictor artifact")


def needs_model(name: str, spec: str | Path | None = None) -> bool:
    """Whether the predictor a name (and artifact path) stands for runs the live model."""
    entry = builtin(name) if spec is None else None
    if entry is not None:
        return entry.needs == "model"
    path = spec if spec is not None else name
    return is_artifact(path) and issubclass(predictor_class(read_predictor_meta(path).kind), HiddenLookahead)


def _load_model(model_dir: str | Path):
    import torch

    from prescient.loading import load_model

    return load_model(model_dir, dtype=torch.float32)[0]


def build_builtin(name: str, *, fit: Trace | None = None, evaluated: Trace | None = None,
                  model_dir: str | Path | None = None, trace_dir: str | None = None) -> ExpertPredictor:
    """The built-in predictor `name`: fit on `fit`, reading `evaluated`, or running `model_dir`."""
    entry = builtin(name)
    if entry is None:
        check_name(name, "")
    given = {"train trace": fit, "evaluated trace": evaluated, "model": model_dir}[entry.needs]
    if given is None:
        raise MissingPredictorInputError(f"predictor {entry.name!r} needs a {entry.needs}: pass "
                                         + ("--model DIR" if entry.needs == "model" else "--train-trace DIR"))
    if entry.name in FITTED:
        return FITTED[entry.name](fit, trace_dir=trace_dir)
    if entry.name == "oracle":
        return OraclePredictor(evaluated)
    from predictor.lookahead import GateLookahead

    return GateLookahead(_load_model(model_dir))


def resolve_predictor(name: str, spec: str | Path | ExpertPredictor | None, *, evaluated: Trace,
                      fit: Trace, fit_on: str, model_dir: str | Path | None = None,
                      ) -> tuple[ExpertPredictor, dict[str, Any]]:
    """The predictor `name` stands for, checked against the evaluated trace's model, and where it
    came from. `spec`: None (a built-in name, or `name` is an artifact path), an artifact path,
    or a built predictor."""
    fp = evaluated.fingerprint
    if isinstance(spec, ExpertPredictor):
        fp.require_same(spec.meta.fingerprint, f"predictor {name!r}")
        return spec, {"fit_on": spec.meta.training or None}
    entry = builtin(name) if spec is None else None
    if entry is None:
        path = spec if spec is not None else name
        check_name(name, spec)
        pred = load_predictor(path, fingerprint=fp)  # FingerprintMismatchError names both models
        if isinstance(pred, HiddenLookahead):
            if model_dir is None:
                raise MissingPredictorInputError(f"predictor {name!r} ({pred.kind}) runs the live model: pass --model DIR")
            pred.bind(_load_model(model_dir))
            return pred, {"artifact": str(path), "model": str(model_dir), "fit_on": pred.meta.training or None}
        return pred, {"artifact": str(path), "fit_on": pred.meta.training or None}
    pred = build_builtin(name, fit=fit, evaluated=evaluated, model_dir=model_dir)
    if entry.needs == "model":
        pred.meta.fingerprint.require_same(fp, "the evaluated trace")
        return pred, {"model": str(model_dir), "fit_on": None}
    if entry.needs == "evaluated trace":
        return pred, {"fit_on": "the evaluated trace (the router's own choices)"}
    return pred, {"fit_on": fit_on}
