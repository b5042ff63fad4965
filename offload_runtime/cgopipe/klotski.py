"""Klotski's expert-aware multi-batch pipeline (Klotski §5-6), beside CGOPipe.

The n micro-batches of a batch form Klotski's batch group and share each layer's weights. Per
layer i of a pass (the prefill, or a decode step):

    1. request layer i's K hot experts: the top K of the correlation table's rows summed over
       every token's real choice at layer i−1 (layer 0: the table's per-token counts of layer 0
       for the group's input tokens), leaving out the resident ones, hottest first; with
       `early_hot` (the default) they were requested already, the moment layer i−1's gate chose
    2. the attention half of each micro-batch, while those copies run
    3. the gate over all the group's tokens, as one call of the layer's MoE block: the runtime
       requests every activated expert that is not in (the cold ones) at once, right after the
       gate, and computes each expert once over every token of the group that chose it, the
       resident and hot ones (landed) first, then each cold one as its copy lands
       (`OffloadRuntime.arriving` with `arrival_order`)
    4. the group's (layer i−1 → layer i) choices counted into the table: the online update

The table is a copy of the one given (built from a trace by `CorrelationTable.from_trace`), so
updates never reach the caller's table or its file, as Klotski asks; without one, the table starts
empty and learns from the run, ties going to the static hot ranking.

Where this deviates from the paper, and why:
- the gate and attention weights stay resident (the runtime offloads routed experts only), so
  "prefetch the gate" has nothing to move; only experts cross the link;
- a share r_w of each layer's experts stays resident for good (as in CGOPipe, so both run at one
  budget); K counts hot experts beyond those;
- a streamed expert is released when FIFO needs its slot rather than as soon as it is done: at
  the double buffer's budget the slot is not needed sooner, and a copy still in when the next
  pass reaches its layer is not moved again;
- layer 0 has no previous layer in the token's path; its hot experts come from the table's
  per-token counts of layer 0, which the online update leaves as built;
- `early_hot`: layer i's hot experts need only layer i−1's choices, so they are requested as soon
  as layer i−1's gate has chosen, queued behind layer i−1's cold copies (demand loads go first):
  the link keeps moving through layer i−1's expert compute instead of idling until layer i's
  attention starts. `early_hot=False` requests them at layer i's attention, as the paper says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from offload_runtime.cgopipe.zigzag import MicroBatch, ZigZagDecoder
from offload_runtime.engine.loaded import LoadedModel
from predictor.base import PredictorMeta
from predictor.baselines import token_scores
from predictor.correlation import CorrelationTable
from prescient.errors import PrescientError


class KlotskiError(PrescientError):
    """A Klotski schedule was asked for with a hot-expert count K out of range."""


def check_hot_count(hot_count: int, n_experts: int, resident_fraction: float) -> None:
    """Refuse a K outside 0..(the experts a layer streams at r_w)."""
    streamed = n_experts - round(resident_fraction * n_experts)
    if not 0 <= hot_count <= streamed:
        raise KlotskiError(f"K={hot_count} hot experts: at r_w={resident_fraction:g} a layer streams {streamed} of "
                           f"{n_experts} experts, so K must lie in 0..{streamed}")


class KlotskiPipe(ZigZagDecoder):
    def __init__(self, model: LoadedModel, resident_fraction: float, table: CorrelationTable | None = None,
                 hot_count: int | None = None, hot: Sequence[Sequence[float]] | None = None,
                 attention_device: str | None = "cpu", record_events: bool = False, early_hot: bool = True) -> None:
        """`hot_count`: K, the hot experts requested during attention (default: the model's
        top-k, as Klotski); `hot`: the static ranking that picks the resident experts;
        `early_hot`: request layer i's hot experts once layer i−1's gate has chosen (see above)."""
        super().__init__(model, resident_fraction, hot=hot, attention_device=attention_device,
                         record_events=record_events, arrival_order=True)
        self.hot_count = self.runtime.top_k if hot_count is None else hot_count
        check_hot_count(self.hot_count, self.n_experts, resident_fraction)
        fingerprint = self.runtime.fingerprint
        if table is None:
            table = CorrelationTable([torch.zeros(self.n_layers - 1, self.n_experts, self.n_experts)],
                                     torch.zeros(fingerprint.vocab_size, 1, self.n_experts),
                                     PredictorMeta(CorrelationTable.kind, fingerprint, {"path_length": 1}))
        else:
            fingerprint.require_same(table.meta.fingerprint, "the correlation table")
        self.table = CorrelationTable([p.clone() for p in table.pairs], table.layer0_counts.clone(), table.meta)
        self.selected: dict[int, torch.Tensor] = {}  # layer → [T, k] the group's choices in the current pass
        self.activated_share: list[float] = []  # per decode step and layer: share of its experts the group chose
        self.early_hot = early_hot
        self._real: torch.Tensor | None = None  # the group's token rows that are not padding, during a MoE call
        self._hooks = [layer.router.register_forward_hook(self._record(layer)) for layer in self.runtime.layers]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        super().close()

    def hot_experts(self, layer: int, micro: list[MicroBatch]) -> list[int]:
        """Layer `layer`'s K hot experts for the group `micro`, hottest first."""
        if layer == 0:
            ids = torch.cat([mb.tokens.reshape(-1) for mb in micro])[_real_rows(micro)]
            scores = token_scores(self.table.layer0_counts, ids)[:, 0].sum(0)
        else:
            scores = self.table.next_layer_scores(layer - 1, self.selected[layer - 1], self.selected.get(layer - 2))
        ranked = self.hot_order[layer]  # ties go to the static ranking
        order = [ranked[i] for i in torch.argsort(-scores[ranked], stable=True).tolist()]
        return [e for _, e in self._streamed(layer, order)[:self.hot_count]]

    # -- the schedule ----------------------------------------------------------------------------

    def _request_ahead(self, micro: list[MicroBatch], layer: int) -> None:
        if layer == 0:
            self.selected.clear()
        if layer == 0 or not self.early_hot:
            self._request([(layer, e) for e in self.hot_experts(layer, micro)])

    def _experts(self, micro: list[MicroBatch], layer: int) -> None:
        """The layer's MoE block once over every token of the group, then the online update."""
        width = micro[0].hidden.shape[-1]
        rows = [mb.hidden.reshape(-1, width) for mb in micro]
        self._real = _real_rows(micro)
        out = self.stack.ffn_half(layer, torch.cat(rows).unsqueeze(0))[0]  # the gate's hook fills selected[layer]
        for mb, part in zip(micro, out.split([len(r) for r in rows])):
            mb.hidden = part.reshape(mb.hidden.shape)
        self._log("moe", layer, -1)
        if not self._prefilling:
            self.activated_share.append(len(torch.unique(self.selected[layer])) / self.n_experts)
        if layer >= 1:
            self.table.update(layer - 1, self.selected[layer - 1], self.selected[layer], self.selected.get(layer - 2))

    def _record(self, layer):
        """After `layer`'s gate: its real choices; with `early_hot`, the next layer's hot experts requested."""
        def hook(_module: nn.Module, _inputs: tuple, output) -> None:
            _, chosen = layer.adapter.routing(layer, output)
            self.selected[layer.index] = chosen.reshape(-1, chosen.shape[-1]).cpu()[self._real]
            if self.early_hot and layer.index + 1 < self.n_layers:
                self._request([(layer.index + 1, e) for e in self.hot_experts(layer.index + 1, [])])
        return hook


def _real_rows(micro: list[MicroBatch]) -> torch.Tensor:
    """Which of the group's current token rows are real (not left padding), in group order."""
    return torch.cat([mb.mask[:, -mb.tokens.shape[1]:].reshape(-1) for mb in micro]).bool()
