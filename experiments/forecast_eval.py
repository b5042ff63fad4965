"""Forecast quality: after token t, how well does each forecaster guess the experts every MoE
layer's router picks for tokens t+1..t+H of the same sequence?

    write_forecast_eval(TRACE, TRAIN_TRACE, OUT.json, sida=ARTIFACT[, horizon=H, decay_grid=[...]])

    python -c "from experiments.forecast_eval import write_forecast_eval as w; w('runs/base-traces/validation',
        'runs/base-traces/train', 'OUT.json', sida='runs/forecast-base/sida-h8')"

Forecasters (each sees only what is known once token t has been routed):
    sida            the SiDA hash function's forecast heads (its causal state after token t)
    sida-current    the same hash function's guess for token t itself, reused for t+h
                    (a reference: it shows what the heads add; not training-free)
    token           the token table (fit on the training trace) of token t, reused for t+h
    freq            the training trace's global expert frequency
    recency         the experts the router truly picked for token t
    recency-decay   Σ_j γ^j · [expert in the router's top-k of token t−j] over the sequence so far
                    (γ = 1: the sequence's own expert counts); γ is chosen on the training trace
                    from a grid (best recall@2k at h = 1)
    next-token      a count table of the experts of token t+h per token id at t (fit on the
                    training trace): a bigram table, stronger than all four above; reported as a
                    reference beside the issue's training-free forecasters (token table,
                    frequency, recency), not counted among them by the target

Table and recency scores break ties toward globally frequent experts (as the token table does).
Metrics per forecaster and horizon h: recall@k and recall@2k of the router's top-k of token
t+h among the forecaster's top-k / top-2k, over the tokens t whose token t+h exists in the same
sequence (a sequence's last h tokens have no target).

JSON (`forecast_report`; `write_forecast_eval` writes it):
    trace, train_trace     {dir, dataset, split, n_tokens, n_sequences, fingerprint}
    artifact, horizon, top_k, settings {decay_grid, decay, decay_recall_at_2k (training trace, by decay)}
    forecasters.NAME       {training_free, sees, horizons: {"h": {recall_at_k, recall_at_2k, n_tokens}}}
    target                 recall@2k at h = 1: sida, the best training-free forecaster (token, freq,
                           recency, recency-decay), margin, goal 0.10, met; and the margin over next-token
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from experiments.predictor_scores import forecast_scores
from predictor.artifact import load_predictor
from predictor.base import ExpertPredictor
from predictor.baselines import TIE_BREAK, TokenTablePredictor, expert_counts, normalise
from predictor.metrics import recall_at
from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError
from prescient.traces import Trace, load_trace

log = logging.getLogger(__name__)

TRAINING_FREE = ("token", "freq", "recency", "recency-decay")  # the training-free forecasters
DECAY_GRID = (0.25, 0.5, 0.75, 0.9, 0.95, 1.0)  # recency-decay's choices, fit on the training trace
TARGET_MARGIN = 0.10  # recall@2k at h = 1: SiDA's forecasts over the best training-free forecaster
Scores = Callable[[int], torch.Tensor]  # horizon h -> [N, L, E] scores, row t's guess for token t+h


class ForecastEvalError(PrescientError):
    """A forecast evaluation was asked for with missing or inconsistent inputs."""


def future_rows(trace: Trace, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows t, rows t+h) of every token whose token t+h is in the same sequence (a sequence's
    rows are contiguous and in order)."""
    seq = trace["seq_id"]
    source = torch.nonzero(seq[:-h] == seq[h:]).flatten()
    return source, source + h


def recency_scores(trace: Trace, decay: float, tie_break: torch.Tensor) -> torch.Tensor:
    """[N, L, E]: Σ_j decay^j · [expert in the router's top-k of token t−j] over the sequence up
    to token t, plus `tie_break` [L, E] (decay 0: the experts of token t alone)."""
    fp = trace.fingerprint
    out = torch.zeros(len(trace), fp.n_moe_layers, fp.n_experts).scatter_(-1, trace["topk_ids"].long(), 1.0)
    position = trace["position"].long()
    for p in range(1, int(position.max()) + 1):  # position order: row t − 1 is final before row t
        rows = torch.nonzero(position == p).flatten()
        out[rows] += decay * out[rows - 1]
    return out + tie_break


def fit_decay(fit: Trace, grid: list[float], tie_break: torch.Tensor) -> tuple[float, dict[str, float]]:
    """The decay of the grid with the best recall@2k at h = 1 on the training trace, and the
    recall of each."""
    source, target = future_rows(fit, 1)
    true, n = fit["topk_ids"][target], 2 * fit.fingerprint.top_k
    recalls = {decay: float(recall_at(recency_scores(fit, decay, tie_break)[source], true, n)) for decay in grid}
    return max(recalls, key=recalls.get), {str(decay): value for decay, value in recalls.items()}


def next_token_table(fit: Trace, h: int) -> torch.Tensor:
    """[V, L, E] counts of the router's top-k of token t+h per token id at t (the training trace)."""
    fp = fit.fingerprint
    source, target = future_rows(fit, h)
    return expert_counts(fit["topk_ids"][target], fp.n_experts, fit["token_id"][source], fp.vocab_size)


def horizon_recalls(scores: Scores, trace: Trace, horizon: int) -> dict[str, dict[str, float]]:
    """{"h": {recall_at_k, recall_at_2k, n_tokens}} for h = 1..horizon."""
    k = trace.fingerprint.top_k
    out = {}
    for h in range(1, horizon + 1):
        source, target = future_rows(trace, h)
        guess, true = scores(h)[source], trace["topk_ids"][target]
        out[str(h)] = {"recall_at_k": float(recall_at(guess, true, k)),
                       "recall_at_2k": float(recall_at(guess, true, 2 * k)), "n_tokens": len(source)}
    return out


def _table_scores(counts: torch.Tensor, token_ids: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
    """Per-token frequencies [N, L, E] from a [V, L, E] count table, ties broken by `tie_break`."""
    return normalise(counts[token_ids.long()]) + tie_break


def forecasters(trace: Trace, fit: Trace, sida: ExpertPredictor | None, horizon: int, decay: float,
                frequency: torch.Tensor) -> dict[str, tuple[Scores, dict[str, Any]]]:
    """Every forecaster's scores by horizon, with what it sees. `frequency` [L, E]: the
    training trace's global expert frequency."""
    tie_break = TIE_BREAK * frequency
    token = TokenTablePredictor.from_trace(fit).predict(trace["token_id"][None])[0]
    freq = frequency.expand(len(trace), *frequency.shape)
    recent = recency_scores(trace, 0.0, tie_break)
    decayed = recency_scores(trace, decay, tie_break)
    out: dict[str, tuple[Scores, dict[str, Any]]] = {}
    if sida is not None:
        current, ahead = forecast_scores(sida, trace, horizon)
        out["sida"] = (lambda h: ahead[:, h - 1], {"sees": "tokens up to t; forecast heads for t+h"})
        out["sida-current"] = (lambda h: current, {"sees": "tokens up to t; the guess for token t itself"})
    out["token"] = (lambda h: token, {"sees": "token t; the token table fit on the training trace"})
    out["freq"] = (lambda h: freq, {"sees": "nothing; the training trace's global frequency"})
    out["recency"] = (lambda h: recent, {"sees": "the router's true experts of token t"})
    out["recency-decay"] = (lambda h: decayed, {
        "sees": f"the router's true experts of tokens t-j of the sequence so far, weight {decay}^j"})
    out["next-token"] = (lambda h: _table_scores(next_token_table(fit, h), trace["token_id"], tie_break),
                         {"sees": "token t; counts of token t+h's experts per token id, training trace"})
    return out


def _target(results: dict[str, Any]) -> dict[str, Any]:
    """SiDA's recall@2k at h = 1 against the best training-free forecaster."""
    at = {name: entry["horizons"]["1"]["recall_at_2k"] for name, entry in results.items()}
    best = max(TRAINING_FREE, key=at.get)
    target: dict[str, Any] = {"horizon": 1, "metric": "recall_at_2k", "best_training_free": best,
                              "best_training_free_recall_at_2k": at[best], "goal_margin": TARGET_MARGIN}
    if "sida" in at:
        margin = at["sida"] - at[best]
        target.update(sida_recall_at_2k=at["sida"], margin=margin, met=margin >= TARGET_MARGIN,
                      margin_over_next_token=at["sida"] - at["next-token"])
    return target


def forecast_report(trace: Trace, fit: Trace, sida: ExpertPredictor | None = None, horizon: int | None = None,
                    decay_grid: tuple[float, ...] = DECAY_GRID) -> dict[str, Any]:
    """Recall@k and recall@2k per horizon for every forecaster (see module doc). `horizon`
    defaults to the SiDA artifact's; without an artifact it is required."""
    trace.fingerprint.require_same(fit.fingerprint, "the training trace")
    if sida is not None:
        trace.fingerprint.require_same(sida.meta.fingerprint, "the SiDA predictor")
        horizon = sida.horizon if horizon is None else horizon
        sida.require_horizon(horizon)  # no heads, or fewer than asked: says what to train
    if not horizon or horizon < 1:
        raise ForecastEvalError("give a horizon ≥ 1 (or a SiDA predictor with forecast heads, whose horizon is used)")
    frequency = normalise(expert_counts(fit["topk_ids"], fit.fingerprint.n_experts))
    decay, decay_recalls = fit_decay(fit, list(decay_grid), TIE_BREAK * frequency)
    results = {}
    for name, (scores, info) in forecasters(trace, fit, sida, horizon, decay, frequency).items():
        results[name] = {"training_free": name in TRAINING_FREE, **info,
                         "horizons": horizon_recalls(scores, trace, horizon)}
        log.info("%s: %s", name, results[name]["horizons"])
    return {"horizon": horizon, "top_k": trace.fingerprint.top_k,
            "settings": {"decay_grid": list(decay_grid), "decay": decay, "decay_recall_at_2k": decay_recalls},
            "forecasters": results, "target": _target(results)}


def write_forecast_eval(trace: str, train_trace: str, out: str, sida: str | None = None,
                        horizon: int | None = None, decay_grid: list[float] | None = None) -> dict[str, Any]:
    """Evaluate forecasts on `trace` and write the JSON report to `out`.

    Args:
        trace: trace directory to evaluate on (e.g. the validation split).
        train_trace: trace directory the tables and the recency decay are fit on.
        out: JSON file to write.
        sida: SiDA predictor artifact with forecast heads (NAME, NAME.json or NAME.safetensors).
        horizon: horizons 1..horizon to report; default: the artifact's.
        decay_grid: decays the recency-decay forecaster chooses from on the training trace.
    """
    evaluated, fit = load_trace(trace), load_trace(train_trace)
    pred = load_predictor(sida, fingerprint=evaluated.fingerprint) if sida else None
    report = {"trace": evaluated.describe(trace), "train_trace": fit.describe(train_trace), "artifact": sida,
              **forecast_report(evaluated, fit, pred, horizon, tuple(decay_grid or DECAY_GRID))}
    write_json_atomic(Path(out), report)
    log.info("wrote %s", out)
    return report
