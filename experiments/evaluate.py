"""`prescient evaluate`: how well each predictor guesses the router's experts on a trace.

    prescient evaluate --trace DIR [--train-trace DIR] [--model DIR] \
        --predictors sida=PATH,corr,token,freq,lookahead,oracle --json OUT.json [--plot OUT.png] \
        [--cross code=TRAIN:EVAL:ARTIFACT,docs=TRAIN:EVAL:ARTIFACT]

Predictors, by name:
    freq, token, corr   fit on `--train-trace` (else on the evaluated trace: "same trace (optimistic)")
    oracle              the evaluated trace's own router choices (recall 1: the upper bound)
    lookahead           gate-lookahead; runs the live `--model` over every traced sequence
    NAME=PATH           any predictor artifact (SiDA, a hidden-state probe, or a saved table);
                        checked against the trace's model fingerprint; a probe runs the live
                        `--model` as lookahead does

Each predictor sees what it would see when serving, and the JSON says what that was:
tables see the token alone; a causal SiDA hash and gate-lookahead see the sequence up to the
token (`predict` over a whole traced window equals decoding it token by token for a causal
predictor); a bidirectional SiDA hash sees the whole window, future tokens included
(`"causal": false`). `corr` (Klotski) guesses layer 0 from its per-token table and layer
l+1 from the experts the router *truly* selected at layer l (`next_layer_scores`, run after
each gate at serving time): `"uses_true_previous_layer": true`.

Metrics per predictor, overall and per MoE layer:
    recall_at_k, recall_at_2k   share of the router's top-k found in the predicted top-k / top-2k
    batch.B                     B consecutive traced sequences decoded together: at each step
                                and layer, predicted set = union of the active rows' predicted
                                top-k, true set = union of their true top-k; precision and
                                recall are averaged over steps and layers. At B = 1 both sets
                                hold k experts, so precision = recall = recall_at_k.
    ahead."a"                   in-token lookahead (gate lookahead, probe), a = 1..`ahead` layers
                                ahead: recall_at_k / recall_at_2k of every layer j ≥ a guessed from
                                layer j − a's block input, their mean over those layers, and
                                per_layer lists with null for the layers j < a (no source that far back)

`cross_dataset` evaluates each dataset's artifact (and the token table fit on that dataset's
train trace) on every dataset's eval trace: a matrix of recall@k per (train, eval) dataset.

JSON (`evaluate_predictors`; `run` adds "cross_dataset" when --cross is given):

    trace, train_trace      {dir, dataset, split, n_tokens, n_sequences, fingerprint}; train_trace null if absent
    model, top_k, batch_sizes
    predictors.NAME         kind, fit_on, [artifact | model], sees, causal, uses_true_previous_layer, [note],
                            recall_at_k, recall_at_2k, per_layer.{recall_at_k, recall_at_2k} (lists over layers),
                            [ahead."a".{layers, recall_at_k, recall_at_2k, per_layer.{recall_at_k, recall_at_2k}}],
                            batch."B".{precision, recall, mean_predicted_experts, mean_true_experts,
                                       per_layer.{precision, recall}}
    forecasts.NAME          for a predictor with forecast heads: `experiments.forecast_eval.forecast_report`
                            (recall@k / recall@2k per horizon, beside token table, frequency and recency)
    timing                  {predictors_s: {NAME: seconds}, total_s}
    cross_dataset           {datasets, train_datasets, artifacts, predictor|token: {recall_at_k|recall_at_2k:
                             {TRAIN_DATASET: {EVAL_DATASET: value}}}}
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.forecast_eval import forecast_report
from experiments.predictor_scores import _equal_length_batches, trace_scores
from predictor.base import ExpertPredictor
from predictor.baselines import OraclePredictor
from predictor.lookahead import HiddenLookahead
from predictor.metrics import recall_at
from predictor.registry import check_name, needs_model, resolve_predictor
from prescient.errors import PrescientError
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from prescient.traces import Trace, load_trace

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 8, 32)
AHEAD = 3  # in-token lookahead reported 1..AHEAD layers ahead
Spec = str | Path | ExpertPredictor | None  # None: a built-in name; a path: an artifact


class EvaluationError(PrescientError):
    """An evaluation was asked for with missing or malformed inputs."""


def check_specs(predictors: dict[str, Spec], model_dir: str | Path | None) -> None:
    """Fail before any work on an unknown name or a lookahead without a model."""
    if not predictors:
        raise EvaluationError("no predictors to evaluate: name at least one (e.g. --predictors freq,token)")
    for name, spec in predictors.items():
        if spec is None:
            check_name(name)
    live = [name for name, spec in predictors.items() if not isinstance(spec, ExpertPredictor) and needs_model(name, spec)]
    if live and model_dir is None:
        raise EvaluationError(f"predictor {', '.join(map(repr, live))} runs the live model: pass --model DIR")


# --- metrics -------------------------------------------------------------------------------
def _recalls(scores: torch.Tensor, true: torch.Tensor, n: int) -> tuple[float, list[float]]:
    per_layer = [float(recall_at(scores[:, i : i + 1], true[:, i : i + 1], n)) for i in range(true.shape[1])]
    return float(recall_at(scores, true, n)), per_layer


def _one_hot(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    return torch.zeros(*ids.shape[:-1], n_experts, dtype=torch.bool).scatter_(-1, ids.long(), True)


def batch_set_metrics(scores: torch.Tensor, true: torch.Tensor, sequences: list[torch.Tensor],
                      batch_size: int) -> dict[str, Any]:
    """Precision and recall of the union of predicted top-k against the union of true top-k,
    per decode step and layer of `batch_size` consecutive sequences decoded together."""
    n, n_layers, n_experts = scores.shape
    k = true.shape[-1]
    seq_index, step = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    for i, rows in enumerate(sequences):
        seq_index[rows], step[rows] = i, torch.arange(len(rows))
    key = (seq_index // batch_size) * (int(step.max()) + 1) + step  # one key per (batch, step)
    _, group = torch.unique(key, return_inverse=True)
    n_groups = int(group.max()) + 1

    def union(sets: torch.Tensor) -> torch.Tensor:  # [N, L, E] bool -> [groups, L, E]: OR per group
        return torch.zeros(n_groups, n_layers, n_experts, dtype=torch.bool).index_put_((group,), sets, accumulate=True)

    predicted = union(_one_hot(scores.topk(k, dim=-1).indices, n_experts))
    actual = union(_one_hot(true, n_experts))
    hits = (predicted & actual).sum(-1).float()  # [groups, L]
    n_pred, n_true = predicted.sum(-1).float(), actual.sum(-1).float()
    precision, recall = hits / n_pred, hits / n_true
    return {
        "precision": float(precision.mean()), "recall": float(recall.mean()),
        "mean_predicted_experts": float(n_pred.mean()), "mean_true_experts": float(n_true.mean()),
        "per_layer": {"precision": precision.mean(0).tolist(), "recall": recall.mean(0).tolist()},
    }


def predictor_metrics(scores: torch.Tensor, trace: Trace, batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    true = trace["topk_ids"].long()
    k = true.shape[-1]
    at_k, at_k_layers = _recalls(scores, true, k)
    at_2k, at_2k_layers = _recalls(scores, true, 2 * k)
    sequences = trace.sequences()
    return {
        "recall_at_k": at_k, "recall_at_2k": at_2k,
        "per_layer": {"recall_at_k": at_k_layers, "recall_at_2k": at_2k_layers},
        "batch": {str(b): batch_set_metrics(scores, true, sequences, b) for b in batch_sizes},
    }


LOOKAHEAD_INFO = {
    "sees": "the window up to and including the token", "causal": True, "uses_true_previous_layer": False,
    "note": "layer 0 is layer 0's own router on its own input (exact); layer j is guessed from MoE layer "
            "j-1's block input (see `ahead` for j-a)"}


def lookahead_scores(pred: HiddenLookahead, trace: Trace, aheads: range) -> dict[int, torch.Tensor]:
    """{a: scores [N, L, E] of every trace row guessed `a` layers ahead}, one model run per
    batch of traced sequences (each from its first token)."""
    fp = trace.fingerprint
    out = {a: torch.empty(len(trace), fp.n_moe_layers, fp.n_experts) for a in aheads}
    with torch.inference_mode():
        for rows in tqdm(_equal_length_batches(trace), desc=f"lookahead {pred.kind}", unit="batch", leave=False):
            for a, scores in pred.predict_ahead(trace["token_id"][rows], aheads).items():
                out[a][rows] = scores
    return out


def ahead_metrics(scores: torch.Tensor, trace: Trace, ahead: int) -> dict[str, Any]:
    """recall@k and recall@2k of layers `ahead`..L−1 (guessed `ahead` layers ahead), per layer and overall."""
    true = trace["topk_ids"].long()
    k = true.shape[-1]
    result: dict[str, Any] = {"layers": list(range(ahead, true.shape[1])), "per_layer": {}}
    for name, n in (("recall_at_k", k), ("recall_at_2k", 2 * k)):
        result[name], per_layer = _recalls(scores[:, ahead:], true[:, ahead:], n)
        result["per_layer"][name] = [None] * ahead + per_layer
    return result


# --- entry points --------------------------------------------------------------------------
def evaluate_predictors(
    trace_dir: str | Path,
    predictors: dict[str, Spec],
    model_dir: str | Path | None = None,
    train_trace: str | Path | None = None,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    ahead: int = AHEAD,
) -> dict[str, Any]:
    """Evaluate every predictor on the trace at `trace_dir`; the result is the JSON of the
    module doc. `predictors` maps a name to None (a built-in: freq, token, corr, oracle,
    lookahead), an artifact path, or a built predictor. In-token lookahead is also reported
    1..`ahead` layers ahead (as far as each predictor and the model reach)."""
    start = time.perf_counter()
    check_specs(predictors, model_dir)
    trace = load_trace(trace_dir)
    if train_trace is not None:
        fit = load_trace(train_trace)
        trace.fingerprint.require_same(fit.fingerprint, f"train trace {train_trace}")
        fit_on = str(train_trace)
    else:
        fit, fit_on = trace, "same trace (optimistic)"
    result: dict[str, Any] = {
        "trace": trace.describe(trace_dir), "train_trace": fit.describe(train_trace) if train_trace else None,
        "model": str(model_dir) if model_dir else None, "top_k": trace.fingerprint.top_k,
        "batch_sizes": list(batch_sizes), "predictors": {}, "timing": {"predictors_s": {}},
    }
    for name, spec in tqdm(predictors.items(), desc="predictors", unit="pred"):
        began = time.perf_counter()
        pred, source = resolve_predictor(name, spec, evaluated=trace, fit=fit, fit_on=fit_on, model_dir=model_dir)
        by_ahead: dict[int, torch.Tensor] = {}
        if isinstance(pred, HiddenLookahead):
            by_ahead = lookahead_scores(pred, trace, range(1, min(ahead, pred.max_ahead) + 1))
            scores, info = by_ahead[1], LOOKAHEAD_INFO
        else:
            scores, info = trace_scores(pred, trace, name)
        result["predictors"][name] = {"kind": pred.kind, **source, **info,
                                      **predictor_metrics(scores, trace, batch_sizes)}
        if by_ahead:
            result["predictors"][name]["ahead"] = {str(a): ahead_metrics(s, trace, a) for a, s in by_ahead.items()}
        # forecast heads: recall per horizon beside the training-free forecasters (the oracle's are
        # the trace itself: recall 1 at every horizon)
        if pred.horizon > 0 and not isinstance(pred, OraclePredictor):
            result.setdefault("forecasts", {})[name] = forecast_report(trace, fit, pred)
        result["timing"]["predictors_s"][name] = round(time.perf_counter() - began, 3)
        log.info("%-10s recall@k %.3f  recall@2k %.3f", name, result["predictors"][name]["recall_at_k"],
                 result["predictors"][name]["recall_at_2k"])
    result["timing"]["total_s"] = round(time.perf_counter() - start, 3)
    return result


def cross_dataset(
    model_dir: str | Path | None,
    traces: dict[str, tuple[str | Path, str | Path]],
    predictor_paths: dict[str, str | Path],
) -> dict[str, Any]:
    """recall@k and recall@2k of each dataset's predictor artifact (rows: the dataset it was
    trained on) on each dataset's eval trace (columns), beside the token table fit on the
    row's train trace. `traces`: dataset -> (train trace, eval trace). With `model_dir`,
    every trace must come from that model."""
    if model_dir is not None:
        model, layers = load_model(model_dir, dtype=torch.float32)
        model_fp = fingerprint_model(model, layers)
        for train, evaluated in traces.values():
            for path in (train, evaluated):
                model_fp.require_same(load_trace(path).fingerprint, f"trace {path}")
    matrix: dict[str, Any] = {"datasets": list(traces), "train_datasets": list(predictor_paths),
                              "artifacts": {d: str(p) for d, p in predictor_paths.items()}}
    for column in ("predictor", "token"):
        matrix[column] = {"recall_at_k": {}, "recall_at_2k": {}}
    for train_ds, artifact in predictor_paths.items():
        if train_ds not in traces:
            raise EvaluationError(f"artifact of dataset {train_ds!r} has no traces; datasets: {', '.join(traces)}")
        for eval_ds, (_, eval_trace) in traces.items():
            res = evaluate_predictors(eval_trace, {"predictor": artifact, "token": None},
                                      train_trace=traces[train_ds][0], batch_sizes=())
            for column in ("predictor", "token"):
                for metric in ("recall_at_k", "recall_at_2k"):
                    matrix[column][metric].setdefault(train_ds, {})[eval_ds] = res["predictors"][column][metric]
    return matrix
