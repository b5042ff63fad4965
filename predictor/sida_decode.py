"""SiDA's causal decode step fused into one compiled call: the hash-building work of one token.

The runtime runs the predictor inline, between the model's layers, once a token. By then the
model's expert weights (tens of MB a token) have streamed through the CPU's caches, so the step's
~1.1 MB of weights and torch's dispatch code are cold: on the demo's SiDA predictor the module's
step and forecasts take 0.14 ms warm and 0.49 ms after 90 MB of weights streamed, this single
compiled call (numba, one pass over the weights) 0.04 and 0.16 ms (`prescient bench-predictor-latency
[--cold-mb 90]`, results/predictor-latency-demo-{warm,cold}.json). Same math as
`SiDAHash.step` + `forecasts` in float32 (LSTM cells, the sparsemax attention over the last W
outputs, the heads), in another summation order: within ~2e-6 of it (tested).

The sparsemax is written out here, not `entmax.sparsemax` (training and `SiDAHash.step` use that):
a torch call in the middle would bring back the dispatch this module exists to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch


@dataclass
class DecodeWeights:
    """The folded, eval-mode hash function's weights as float32 arrays (views where they can be)."""

    table: np.ndarray  # [V, d_c] the folded token projection
    w_ih_first: np.ndarray  # [4H, d_c] the first LSTM layer's input weights
    w_ih_rest: np.ndarray  # [layers-1, 4H, H] the other layers' (an empty [0, 4H, H] with one layer)
    w_hh: np.ndarray  # [layers, 4H, H]
    bias: np.ndarray  # [layers, 4H] bias_ih + bias_hh
    query_key: np.ndarray  # [H, H] W_qᵀW_k
    scale: float
    head_w: np.ndarray  # [L·E, H]
    head_b: np.ndarray
    forecast_w: np.ndarray  # [horizon·L·E, H] (an empty [0, H] without forecast heads)
    forecast_b: np.ndarray

    @classmethod
    def of(cls, hash_fn: torch.nn.Module) -> "DecodeWeights":
        lstm, layers, width = hash_fn.lstm, hash_fn.sizes.lstm_layers, hash_fn.sizes.hidden_dim

        def array(tensor: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(tensor.detach().float().numpy())

        def stacked(name: str, first: int) -> np.ndarray:
            tensors = [getattr(lstm, f"{name}_l{i}") for i in range(first, layers)]
            return array(torch.stack(tensors)) if tensors else np.zeros((0, 4 * width, width), np.float32)

        heads = hash_fn.forecast_head
        return cls(
            table=array(hash_fn.token_proj.weight), w_ih_first=array(lstm.weight_ih_l0),
            w_ih_rest=stacked("weight_ih", 1), w_hh=stacked("weight_hh", 0),
            bias=array(torch.stack([getattr(lstm, f"bias_ih_l{i}") + getattr(lstm, f"bias_hh_l{i}")
                                    for i in range(layers)])),
            query_key=array(hash_fn.query.weight.T @ hash_fn.key.weight), scale=float(hash_fn.scale),
            head_w=array(hash_fn.head.weight), head_b=array(hash_fn.head.bias),
            forecast_w=array(heads.weight) if heads is not None else np.zeros((0, width), np.float32),
            forecast_b=array(heads.bias) if heads is not None else np.zeros(0, np.float32))


@dataclass
class DecodeState:
    """Per row of the batch: the LSTM's state, the last W outputs (a ring) and the last token's
    logits, forecasts and feature."""

    h: np.ndarray  # [B, layers, H]
    c: np.ndarray  # [B, layers, H]
    values: np.ndarray  # [B, W, H] the attention memory, a ring: token t's output at t mod W
    seen: int  # tokens stepped (every row steps together)
    forecasts: np.ndarray | None = None  # [B, horizon·L·E] after the last token
    feature: np.ndarray | None = None  # [B, H]

    @classmethod
    def start(cls, batch_size: int, layers: int, width: int, window: int) -> "DecodeState":
        return cls(np.zeros((batch_size, layers, width), np.float32), np.zeros((batch_size, layers, width), np.float32),
                   np.zeros((batch_size, window, width), np.float32), 0)


def step(weights: DecodeWeights, state: DecodeState, token_ids: torch.Tensor) -> np.ndarray:
    """One new token per row: the [B, L·E] logits of its experts; `state` steps over it (its
    forecasts and feature are the new token's)."""
    return step_tokens(weights, state, token_ids.reshape(-1).numpy().astype(np.int64))


def step_tokens(weights: DecodeWeights, state: DecodeState, tokens: np.ndarray) -> np.ndarray:
    """`step` of the rows' token ids as an int64 array."""
    if len(tokens) and not 0 <= tokens.min() <= tokens.max() < len(weights.table):  # compiled code checks no bounds
        raise IndexError(f"token id {tokens.max() if tokens.max() >= len(weights.table) else tokens.min()} is outside "
                         f"the predictor's vocabulary of {len(weights.table)}")
    batch = len(tokens)
    logits = np.empty((batch, len(weights.head_b)), np.float32)
    forecasts = np.empty((batch, len(weights.forecast_b)), np.float32)
    feature = np.empty((batch, state.h.shape[2]), np.float32)
    w = weights
    for row in range(batch):
        _step_row(w.table[tokens[row]], state.h[row], state.c[row], w.w_ih_first, w.w_ih_rest, w.w_hh, w.bias,
                  state.values[row], state.seen, w.query_key, np.float32(w.scale), w.head_w, w.head_b,
                  w.forecast_w, w.forecast_b, logits[row], forecasts[row], feature[row])
    state.seen += 1
    state.forecasts, state.feature = forecasts, feature
    return logits


@numba.njit(fastmath=True, nogil=True, cache=True)
def _lstm_cell(x, h, c, w_ih, w_hh, bias):  # pragma: no cover - compiled
    """torch.lstm_cell in place: gates (i, f, g, o) = W_ih x + W_hh h + b."""
    width = h.shape[0]
    gates = bias.copy()
    for r in range(4 * width):
        acc = np.float32(0.0)
        for k in range(x.shape[0]):
            acc += w_ih[r, k] * x[k]
        for k in range(width):
            acc += w_hh[r, k] * h[k]
        gates[r] += acc
    for j in range(width):
        forget = 1.0 / (1.0 + np.exp(-gates[width + j]))
        keep = 1.0 / (1.0 + np.exp(-gates[j])) * np.tanh(gates[2 * width + j])
        c[j] = forget * c[j] + keep
        h[j] = 1.0 / (1.0 + np.exp(-gates[3 * width + j])) * np.tanh(c[j])


@numba.njit(fastmath=True, nogil=True, cache=True)
def _linear(weight, bias, x, out):  # pragma: no cover - compiled
    for r in range(weight.shape[0]):
        acc = bias[r]
        for k in range(x.shape[0]):
            acc += weight[r, k] * x[k]
        out[r] = acc


@numba.njit(fastmath=True, nogil=True, cache=True)
def _sparsemax_threshold(scores):  # pragma: no cover - compiled
    """τ of sparsemax(z) = max(z − τ, 0) (Martins & Astudillo, 2016): over z sorted descending,
    the largest k with 1 + k·z_(k) > Σ_{i≤k} z_(i) gives τ = (Σ_{i≤k} z_(i) − 1) / k."""
    ordered = np.sort(scores)[::-1]
    total, tau = np.float32(0.0), np.float32(0.0)
    for i in range(len(ordered)):
        total += ordered[i]
        if 1.0 + (i + 1) * ordered[i] > total:
            tau = (total - 1.0) / (i + 1)
    return tau


@numba.njit(fastmath=True, nogil=True, cache=True)
def _step_row(x, h, c, w_ih_first, w_ih_rest, w_hh, bias, values, seen, query_key, scale,
              head_w, head_b, forecast_w, forecast_b, logits, forecasts, feature):  # pragma: no cover - compiled
    _lstm_cell(x, h[0], c[0], w_ih_first, w_hh[0], bias[0])
    for layer in range(1, h.shape[0]):
        _lstm_cell(h[layer - 1].copy(), h[layer], c[layer], w_ih_rest[layer - 1], w_hh[layer], bias[layer])
    out = h[h.shape[0] - 1]
    window, width = values.shape
    values[seen % window] = out
    held = min(seen + 1, window)
    query = np.zeros(width, np.float32)  # out · W_qᵀW_k
    for j in range(width):
        for k in range(width):
            query[k] += out[j] * query_key[j, k]
    scores = np.empty(held, np.float32)
    for s in range(held):
        acc = np.float32(0.0)
        for k in range(width):
            acc += query[k] * values[s, k]
        scores[s] = acc * scale
    tau = _sparsemax_threshold(scores)
    feature[:] = out  # the residual: attention context + the token's own LSTM output
    for s in range(held):
        weight = scores[s] - tau
        if weight > 0:
            for k in range(width):
                feature[k] += weight * values[s, k]
    _linear(head_w, head_b, feature, logits)
    _linear(forecast_w, forecast_b, feature, forecasts)
