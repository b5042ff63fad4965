"""A predictor's scores [N, L, E] for every row of a trace, and what it saw to make them.

`trace_scores` is the one place that decides how each kind runs over a trace and writes the
"sees" record that `evaluate` and `compare-caches` put in their JSON:

- oracle: the router's own choices, looked up by trace coordinates (the bound);
- corr (Klotski): layer 0 from its per-token table, layer l+1 from the experts the router truly
  chose at layer l (`next_layer_scores`, run after each gate when serving);
- tables: the token alone;
- a causal sequence predictor (SiDA, gate-lookahead): the window up to the token (`predict`
  over a whole window equals decoding it token by token);
- a bidirectional SiDA hash: the whole window, future tokens included, or, when `decoding`,
  stepped token by token (`start`/`step`) so that it never sees ahead, as when serving.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from predictor.base import ExpertPredictor, TokenwisePredictor
from predictor.baselines import OraclePredictor
from predictor.correlation import CorrelationTable
from predictor.lookahead import GateLookahead
from prescient.traces import Trace

SEQUENCE_BATCH = 16  # equal-length windows run through a sequence predictor at once


def _equal_length_batches(trace: Trace) -> list[torch.Tensor]:
    """Row indices [b, T] of up to SEQUENCE_BATCH traced sequences of the same length."""
    by_length: dict[int, list[torch.Tensor]] = {}
    for rows in trace.sequences():
        by_length.setdefault(len(rows), []).append(rows)
    return [torch.stack(group[i : i + SEQUENCE_BATCH])
            for group in by_length.values() for i in range(0, len(group), SEQUENCE_BATCH)]


def sequence_scores(pred: ExpertPredictor, trace: Trace, desc: str) -> torch.Tensor:
    """`pred.predict` over each traced sequence (a window from its first token)."""
    fp = trace.fingerprint
    out = torch.empty(len(trace), fp.n_moe_layers, fp.n_experts)
    with torch.inference_mode():
        for rows in tqdm(_equal_length_batches(trace), desc=desc, unit="batch", leave=False):
            out[rows] = pred.predict(trace["token_id"][rows]).float()
    return out


def forecast_scores(pred: ExpertPredictor, trace: Trace, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A predictor with forecast heads over each traced sequence from its first token: scores
    [N, L, E] of each token and its forecasts [N, horizon, L, E] of the tokens after it."""
    fp = trace.fingerprint
    current = torch.empty(len(trace), fp.n_moe_layers, fp.n_experts)
    ahead = torch.empty(len(trace), horizon, fp.n_moe_layers, fp.n_experts)
    for rows in tqdm(_equal_length_batches(trace), desc="forecasts", unit="batch", leave=False):
        current[rows], ahead[rows] = pred.predict_with_forecasts(trace["token_id"][rows], horizon)
    return current, ahead


def stepwise_scores(pred: ExpertPredictor, trace: Trace) -> torch.Tensor:
    """Decode every traced sequence token by token (`start`/`step`): each token is seen once."""
    fp = trace.fingerprint
    out = torch.empty(len(trace), fp.n_moe_layers, fp.n_experts)
    with torch.inference_mode():
        for rows in tqdm(trace.sequences(), desc="predict (step by step)", unit="seq", leave=False):
            state = pred.start(1)
            for row in rows.tolist():
                out[row] = pred.step(state, trace["token_id"][row : row + 1])[0].float()
    return out


def correlation_scores(table: CorrelationTable, trace: Trace) -> torch.Tensor:
    """Layer 0 from the table's per-token guess (as `predict`); layer l+1 from the experts the
    router truly selected at layer l (and l−1 with path length 2), token by token."""
    true = trace["topk_ids"].long()
    layers = [table.predict(trace["token_id"][None])[0, :, 0]]
    for layer in range(table.n_layers - 1):
        if table.path_length == 2 and layer >= 1:
            per_token = torch.vmap(lambda s, p, l=layer: table.next_layer_scores(l, s[None], p[None]))
            layers.append(per_token(true[:, layer], true[:, layer - 1]))
        else:
            layers.append(torch.vmap(lambda s, l=layer: table.next_layer_scores(l, s[None]))(true[:, layer]))
    return torch.stack(layers, dim=1)


def oracle_scores(oracle: OraclePredictor, trace: Trace) -> torch.Tensor:
    """The router's own choices, looked up by trace coordinates."""
    return torch.cat([oracle.rows(int(trace["seq_id"][rows[0]]), torch.arange(len(rows)))
                      for rows in trace.sequences()])


def trace_scores(pred: ExpertPredictor, trace: Trace, name: str = "predictor", *, decoding: bool = False,
                 true_previous_layer: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
    """Scores [N, L, E] of `pred` for every trace row, and what it saw (see the module doc).
    `decoding`: run as when serving (a bidirectional hash is stepped); `true_previous_layer`:
    corr may read the router's true choice at the previous layer (else it is a token table)."""
    if isinstance(pred, OraclePredictor):
        return oracle_scores(pred, trace), {"sees": "the router's true choices", "causal": False,
                                            "uses_true_previous_layer": False}
    if isinstance(pred, CorrelationTable) and true_previous_layer:
        return correlation_scores(pred, trace), {
            "sees": "layer 0: the token; layer l+1: the router's true experts at layer l",
            "causal": True, "uses_true_previous_layer": True}
    if isinstance(pred, TokenwisePredictor):
        with torch.inference_mode():
            scores = pred.predict(trace["token_id"][None])[0].float()
        return scores, {"sees": "the token alone", "causal": True, "uses_true_previous_layer": False}
    bidirectional = bool(pred.meta.hparams.get("bidirectional", False))
    if bidirectional and decoding:
        return stepwise_scores(pred, trace), {
            "sees": "the window up to and including the token (stepped: a bidirectional hash never sees ahead)",
            "causal": True, "uses_true_previous_layer": False}
    info = {"sees": "the whole window, future tokens included" if bidirectional
            else "the window up to and including the token",
            "causal": not bidirectional, "uses_true_previous_layer": False}
    if isinstance(pred, GateLookahead):
        info["note"] = ("layer 0 is layer 0's own router on its own input (exact); "
                        "layers 1.. are the next router on the previous MoE layer's input")
    return sequence_scores(pred, trace, f"predict {name}"), info
