"""Klotski's inter-layer expert correlation table.

Counts, over the tokens of a trace, how often a token that selected expert i at MoE layer l
selects expert j at layer l + d:

    path length 1 (Klotski's default): d = 1, pairs (l → l+1)         pairs[0]  [L−1, E, E]
    path length 2:                     also d = 2, pairs (l−1 → l+1)  pairs[1]  [L−2, E, E]

Main API (serving, multi-batch): once layer l's routers ran, `next_layer_scores(l, selected)`
sums, over every token of the multi-batch, the rows of the experts it selected at l (and,
with path length 2, the rows of those it selected at l−1 toward l+1) and `hot_experts` takes
the top-K as layer l+1's hot experts. Each row is normalised to a conditional distribution
P(j at l+d | i at l), so every token's selection weighs the same whatever the popularity of
its expert (raw-count rows let popular experts outvote rare ones).

`update` adds what the runtime observed to the in-memory table only: a loaded table is a
copy, and nothing writes it back to the artifact (save it explicitly if you want to).

Behind `predict` / `step` (input ids alone): layer 0 is guessed from a per-token table of
layer 0 (falling back to global frequency), then each next layer is chained from the
previous layers' top-k guesses through the same rows. That is a weak use of the table; its
value is in `next_layer_scores` with real router choices.
"""

from __future__ import annotations

import torch

from predictor.base import PredictorError, PredictorMeta, TokenwisePredictor, describe_trace, register_predictor
from predictor.baselines import expert_counts, normalise, token_scores
from prescient.traces import Trace


def pair_counts(topk_ids: torch.Tensor, distance: int, n_experts: int) -> torch.Tensor:
    """[L − distance, E, E] counts of (expert i at l, expert j at l + distance) per token.
    topk_ids [N, L, k]."""
    ids = topk_ids.long()
    n_layers = ids.shape[1]
    out = torch.zeros(max(n_layers - distance, 0), n_experts, n_experts)
    for layer in range(n_layers - distance):
        index = ids[:, layer, :, None] * n_experts + ids[:, layer + distance, None, :]
        out[layer] = torch.bincount(index.flatten(), minlength=n_experts * n_experts).view(n_experts, n_experts)
    return out


@register_predictor
class CorrelationTable(TokenwisePredictor):
    kind = "klotski-correlation"

    def __init__(self, pairs: list[torch.Tensor], layer0_counts: torch.Tensor, meta: PredictorMeta):
        if len(pairs) not in (1, 2):
            raise PredictorError(f"path length must be 1 or 2, got {len(pairs)}")
        self.pairs = pairs  # pairs[d-1]: [L-d, E, E]
        self.layer0_counts = layer0_counts  # [V, 1, E]
        self.meta = meta

    @property
    def path_length(self) -> int:
        return len(self.pairs)

    @classmethod
    def from_trace(cls, trace: Trace, path_length: int = 1, trace_dir: str | None = None) -> "CorrelationTable":
        fp = trace.fingerprint
        topk = trace["topk_ids"]
        pairs = [pair_counts(topk, d, fp.n_experts) for d in range(1, path_length + 1)]
        layer0 = expert_counts(topk[:, :1], fp.n_experts, trace["token_id"], fp.vocab_size)
        meta = PredictorMeta(cls.kind, fp, {"path_length": path_length}, describe_trace(trace.manifest, trace_dir))
        return cls(pairs, layer0, meta)

    # --- serving: real router choices ---------------------------------------------------
    def _rows(self, distance: int, source_layer: int, selected: torch.Tensor) -> torch.Tensor:
        """Conditional rows [*selected.shape, E] of the experts `selected` at `source_layer`."""
        return normalise(self.pairs[distance - 1][source_layer])[selected.long()]

    def next_layer_scores(
        self, layer: int, selected: torch.Tensor, previous: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scores [E] for layer `layer`+1, summed over all tokens. selected [N, k]: the experts
        each token selected at `layer`; previous [N, k]: at `layer`−1 (path length 2 only)."""
        if not 0 <= layer < self.n_layers - 1:
            raise PredictorError(f"layer {layer} has no next MoE layer (model has {self.n_layers})")
        scores = self._rows(1, layer, selected).sum(dim=(0, 1))
        if self.path_length == 2 and previous is not None and layer >= 1:
            scores = scores + self._rows(2, layer - 1, previous).sum(dim=(0, 1))
        return scores

    def hot_experts(
        self, layer: int, selected: torch.Tensor, k: int, previous: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The K experts of layer `layer`+1 to prefetch, best first."""
        return self.next_layer_scores(layer, selected, previous).topk(min(k, self.n_experts)).indices

    def update(
        self, layer: int, selected: torch.Tensor, next_selected: torch.Tensor, previous: torch.Tensor | None = None
    ) -> None:
        """Count what the routers chose (each [N, k], same tokens) into the in-memory table."""
        n_experts = self.n_experts
        self.pairs[0][layer] += pair_counts(torch.stack([selected, next_selected], 1), 1, n_experts)[0]
        if self.path_length == 2 and previous is not None and layer >= 1:
            self.pairs[1][layer - 1] += pair_counts(torch.stack([previous, next_selected], 1), 1, n_experts)[0]

    # --- the predictor interface: input ids alone ---------------------------------------
    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        k = self.meta.fingerprint.top_k
        layers = [token_scores(self.layer0_counts, input_ids)[..., 0, :]]
        chosen = [layers[0].topk(k, dim=-1).indices]
        for layer in range(self.n_layers - 1):
            scores = self._rows(1, layer, chosen[-1]).sum(-2)
            if self.path_length == 2 and layer >= 1:
                scores = scores + self._rows(2, layer - 1, chosen[-2]).sum(-2)
            layers.append(scores)
            chosen.append(scores.topk(k, dim=-1).indices)
        return torch.stack(layers, dim=-2)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"layer0_counts": self.layer0_counts, **{f"pairs_d{d + 1}": p for d, p in enumerate(self.pairs)}}

    @classmethod
    def from_artifact(cls, meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> "CorrelationTable":
        path_length = int(meta.hparams["path_length"])
        pairs = [tensors[f"pairs_d{d}"].clone() for d in range(1, path_length + 1)]
        return cls(pairs, tensors["layer0_counts"].clone(), meta)
