"""Table baselines built from a trace: global expert frequency, per-token-id frequency, and
the oracle (the trace itself: the upper bound every predictor is measured against)."""

from __future__ import annotations

import torch

from predictor.base import (
    ExpertPredictor,
    PredictorError,
    PredictorMeta,
    TokenwisePredictor,
    describe_trace,
    register_predictor,
)
from prescient.traces import Trace

TIE_BREAK = 1e-3  # weight of the global frequency added to per-token scores


def expert_counts(
    topk_ids: torch.Tensor, n_experts: int, token_ids: torch.Tensor | None = None, vocab: int = 1
) -> torch.Tensor:
    """How often each expert was selected: [L, E], or per token id [vocab, L, E] when
    `token_ids` [N] is given. topk_ids [N, L, k]."""
    n_layers = topk_ids.shape[1]
    index = torch.arange(n_layers)[None, :, None] * n_experts + topk_ids.long()
    if token_ids is not None:
        index = index + token_ids.long()[:, None, None] * (n_layers * n_experts)
    counts = torch.bincount(index.flatten(), minlength=vocab * n_layers * n_experts)
    counts = counts.float().view(vocab, n_layers, n_experts)
    return counts if token_ids is not None else counts[0]


def normalise(counts: torch.Tensor) -> torch.Tensor:
    """Counts → frequencies over the last dimension (all-zero rows stay zero)."""
    return counts / counts.sum(-1, keepdim=True).clamp_min(1)


def token_scores(token_counts: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token frequency [*, L, E] for `input_ids` [*] from a [V, L, E] count table. A token
    never seen (or outside the table) scores by the global frequency alone; seen tokens add it
    with weight `TIE_BREAK` so ties break toward globally frequent experts."""
    global_freq = normalise(token_counts.sum(0))
    ids = input_ids.long()
    known = (ids >= 0) & (ids < token_counts.shape[0])
    per_token = normalise(token_counts[ids.clamp(0, token_counts.shape[0] - 1)]) * known[..., None, None]
    return per_token + TIE_BREAK * global_freq


@register_predictor
class FrequencyPredictor(TokenwisePredictor):
    """The experts each layer selects most often, whatever the token."""

    kind = "frequency"

    def __init__(self, counts: torch.Tensor, meta: PredictorMeta):
        self.counts, self.meta = counts, meta  # [L, E]

    @classmethod
    def from_trace(cls, trace: Trace, trace_dir: str | None = None) -> "FrequencyPredictor":
        fp = trace.fingerprint
        meta = PredictorMeta(cls.kind, fp, training=describe_trace(trace.manifest, trace_dir))
        return cls(expert_counts(trace["topk_ids"], fp.n_experts), meta)

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return normalise(self.counts).expand(*input_ids.shape, *self.counts.shape).clone()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts}

    @classmethod
    def from_artifact(cls, meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> "FrequencyPredictor":
        return cls(tensors["counts"].clone(), meta)


@register_predictor
class TokenTablePredictor(TokenwisePredictor):
    """Per token id, the experts each layer selected most often for it in the trace; unseen
    tokens fall back to the global frequency."""

    kind = "token-table"

    def __init__(self, token_counts: torch.Tensor, meta: PredictorMeta):
        self.token_counts, self.meta = token_counts, meta  # [V, L, E]

    @classmethod
    def from_trace(cls, trace: Trace, trace_dir: str | None = None) -> "TokenTablePredictor":
        fp = trace.fingerprint
        meta = PredictorMeta(cls.kind, fp, training=describe_trace(trace.manifest, trace_dir))
        return cls(expert_counts(trace["topk_ids"], fp.n_experts, trace["token_id"], fp.vocab_size), meta)

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return token_scores(self.token_counts, input_ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"token_counts": self.token_counts}

    @classmethod
    def from_artifact(cls, meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> "TokenTablePredictor":
        return cls(tensors["token_counts"].clone(), meta)


def rank_scores(topk_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[*, L, k] expert ids (best first) → [*, L, E] scores: (k − rank)/k on them, 0 elsewhere."""
    k = topk_ids.shape[-1]
    weights = torch.arange(k, 0, -1, dtype=torch.float32) / k
    out = torch.zeros(*topk_ids.shape[:-1], n_experts)
    return out.scatter_(-1, topk_ids.long(), weights.expand(topk_ids.shape).contiguous())


@register_predictor
class OraclePredictor(ExpertPredictor):
    """The router's true choices read back from a trace: recall 1 by construction.

    `rows(seq_id, positions)` answers by trace coordinates. `predict` / `step` answer by token
    content: a token sequence is looked up by a hash of its prefix (from position 0 of a
    traced sequence), so any prefix of a traced sequence is known and anything else raises.
    Its forecasts are the next `FORECAST_HORIZON` tokens' true choices (none past its sequence's
    end), and its chances of being picked are certain, so that learned eviction and cross-token
    prefetch with the oracle measure what perfect foresight would buy.
    Not saved as an artifact: the trace is its storage.
    """

    kind = "oracle"
    certain = True  # learned eviction follows its forecasts alone, with no history of use blended in
    FORECAST_HORIZON = 8  # as far ahead as the deepest forecast heads trained (runs/forecast/sida-h8)
    _SEED = 0x5EED

    def __init__(self, trace: Trace, trace_dir: str | None = None):
        self.trace = trace
        self.meta = PredictorMeta(self.kind, trace.fingerprint, training=describe_trace(trace.manifest, trace_dir))
        self._scores = rank_scores(trace["topk_ids"], self.n_experts)  # [N, L, E]
        self._seq_id = trace["seq_id"]
        tokens = trace["token_id"].tolist()
        self._prefix_row: dict[int, int] = {}
        self._seq_start: dict[int, int] = {}
        for rows in trace.sequences():
            first = int(rows[0])
            self._seq_start[int(self._seq_id[first])] = first
            h = self._SEED
            for row in rows.tolist():
                h = hash((h, tokens[row]))
                self._prefix_row.setdefault(h, row)

    @property
    def horizon(self) -> int:
        return self.FORECAST_HORIZON

    def chance_selected(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        return (scores > 0).float()  # `rank_scores` are positive exactly on the router's choices

    def rows(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Scores [len(positions), L, E] of positions (0-based) in traced sequence `seq_id`."""
        if seq_id not in self._seq_start:
            raise PredictorError(f"sequence {seq_id} is not in the oracle's trace")
        return self._scores[self._seq_start[seq_id] + positions.long()]

    def _row(self, h: int) -> int:
        row = self._prefix_row.get(h)
        if row is None:
            raise PredictorError("the oracle only knows token sequences of its trace (from their first token)")
        return row

    def _prompt_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] trace rows of every token of a batch of prompts."""
        out = []
        for sequence in input_ids.tolist():
            h, rows = self._SEED, []
            for token in sequence:
                h = hash((h, token))
                rows.append(self._row(h))
            out.append(rows)
        return torch.tensor(out, dtype=torch.long)

    def _ahead(self, rows: torch.Tensor, horizon: int) -> torch.Tensor:
        """[..., horizon, L, E] the scores of the `horizon` rows after each of `rows` [...] in its
        sequence; zeros past the sequence's end."""
        later = rows[..., None] + torch.arange(1, horizon + 1)
        inside = later.clamp(max=len(self._seq_id) - 1)
        same = (later < len(self._seq_id)) & (self._seq_id[inside] == self._seq_id[rows][..., None])
        return self._scores[inside] * same[..., None, None]

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._scores[self._prompt_rows(input_ids)]

    def predict_with_forecasts(self, input_ids: torch.Tensor,
                               horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        horizon = self.horizon if horizon is None else horizon
        self.require_horizon(horizon)
        rows = self._prompt_rows(input_ids)
        return self._scores[rows], self._ahead(rows, horizon)

    def start(self, batch_size: int) -> list[int]:
        return [self._SEED] * batch_size

    def step(self, state: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        for b, token in enumerate(token_ids.tolist()):
            state[b] = hash((state[b], token))
        return self._scores[[self._row(h) for h in state]]

    def forecast(self, state: list[int], horizon: int | None = None) -> torch.Tensor:
        horizon = self.horizon if horizon is None else horizon
        self.require_horizon(horizon)
        return self._ahead(torch.tensor([self._row(h) for h in state]), horizon)
