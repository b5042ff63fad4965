"""CGOPipe batch decoding (MoE-Lightning), with Klotski's hot-first expert order.

Many requests decode together, split into micro-batches (`batching.partition_requests`). The
weights: a fraction r_w of each layer's experts — the hottest — stays resident for good; the rest
of a layer streams in every decode step, in as many pages as there are micro-batches, into a
region that holds two layers' worth (a double buffer: the `ExpertCache` with the FIFO policy
and the resident experts pinned, so the runtime keeps one cache). Per decode step, over units
(layer i, micro-batch j) in order:

    request page j of layer i+1's streamed experts (the transfer thread copies it meanwhile)
    FFN half of (i, j): post-attention norm + MoE block (experts resident first, then each
        streamed expert as its copy lands: Klotski's order)
    attention half of the unit two ahead, (i, j+2) or the next layer's (i+1, j+2-n): norm, QKV,
        attention core over its KV cache, output projection

so the attention of micro-batch j+2 and the weight pages overlap the FFN of micro-batch j.
On CPU-only machines everything computes on the CPU and a thread moves the weights; on CUDA the
copies run on the transfer engine's stream, and the attention core can run on the CPU over a
KV cache in CPU memory (`attention_device="cpu"`, the default, as MoE-Lightning chooses for
memory-bound settings); hidden states never queue behind weight pages (those have their own
stream). With a predictor, a SiDA hash-building thread predicts each step's experts from the new
tokens, and each layer's pages go hottest-predicted first; without one (or when its table is
late) the static hot ranking orders them.

The prefill runs FlexGen's zig-zag order (`zigzag.ZigZagDecoder`, which this class extends):
layer by layer over the batch's micro-batches, each layer's streamed experts requested a layer
ahead.

`overlap=False` is the baseline: the same runtime and budget decoding the micro-batches one after
another, each through every layer, loading experts on demand; its prefill goes layer by layer as
above but requests nothing ahead (on demand too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from offload_runtime.cgopipe.zigzag import Event, MicroBatch, ZigZagDecoder, budget_fraction
from offload_runtime.engine.hash_builder import HashBuilder
from offload_runtime.engine.loaded import LoadedModel
from predictor.base import ExpertPredictor

__all__ = ["CGOPipe", "Event", "budget_fraction"]  # budget_fraction: where callers found it first

log = logging.getLogger(__name__)


class CGOPipe(ZigZagDecoder):
    def __init__(self, model: LoadedModel, resident_fraction: float, hot: Sequence[Sequence[float]] | None = None,
                 predictor: ExpertPredictor | None = None, overlap: bool = True,
                 attention_device: str | None = "cpu", record_events: bool = False) -> None:
        super().__init__(model, resident_fraction, hot=hot, attention_device=attention_device,
                         record_events=record_events, arrival_order=overlap)
        self.overlap = overlap
        if predictor is not None:
            self.runtime.fingerprint.require_same(predictor.meta.fingerprint, f"predictor {predictor.kind!r}")
        self.builder = HashBuilder(predictor) if predictor is not None else None

    def close(self) -> None:
        """Stop the hash-building thread; the runtime goes back to the expert order it had."""
        super().close()
        if self.builder is not None:
            self.builder.close()

    # -- decode --------------------------------------------------------------------------------

    def _decode_step(self, micro: list[MicroBatch]) -> None:
        for mb in micro:
            self._embed_step(mb)
        n = len(micro)
        units = [(layer, j) for layer in range(self.n_layers) for j in range(n)]
        if self.overlap:
            pages = self._pages(n)
            self._request([key for page in pages[0] for key in page])
            ahead = min(2, n)  # the attention of unit u+2 needs the FFN of unit u+2-n done
            for u in range(ahead):
                self._attention(micro, *units[u])
            for u, (layer, j) in enumerate(units):
                self._request(pages[(layer + 1) % self.n_layers][j], j)
                self._ffn(micro, layer, j)
                if u + ahead < len(units):
                    self._attention(micro, *units[u + ahead])
        else:
            for j in range(n):
                for layer in range(self.n_layers):
                    self._attention(micro, layer, j)
                    self._ffn(micro, layer, j)

    def _request_ahead(self, micro: list[MicroBatch], layer: int) -> None:
        """The prefill: FlexGen's layer ahead with overlap; nothing ahead (on demand) without."""
        if self.overlap:
            super()._request_ahead(micro, layer)

    def _pages(self, n: int) -> list[list[list[tuple[int, int]]]]:
        """Per layer, its streamed experts in `n` pages, hottest first (predicted for this step's
        tokens when the hash table is ready, else the static ranking)."""
        table = self.builder.poll(self._step) if self.builder is not None else None
        if self.builder is not None and table is None:
            self.stats.late_tables += 1
        pages = []
        for layer in range(self.n_layers):
            order = torch.argsort(-table.scores[layer], stable=True).tolist() if table is not None else None
            streamed = self._streamed(layer, order)
            pages.append([page.tolist() for page in np.array_split(np.array(streamed, dtype=np.int64).reshape(-1, 2), n)])
        return pages

    # -- the hash-building thread --------------------------------------------------------------

    def _prefilled(self, micro: list[MicroBatch], prompts: list[list[Sequence[int]]], pad_token_id: int) -> None:
        """Hand the predictor every request's prompt (one left-padded [N, T] batch) and the
        first tokens, whose table the first decode step uses."""
        if self.builder is None:
            return
        flat = [p for group in prompts for p in group]
        width = max(len(p) for p in flat)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in flat])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in flat])
        # the prompt's table is not used (prefill loads a layer ahead); its state leads into the first step
        self.builder.submit(-1, ids, new_sequence=True, attention_mask=mask)
        self._step_done(micro)

    def _step_done(self, micro: list[MicroBatch]) -> None:
        """Hand the predictor each step's new tokens ([N, 1]) for the next step's table."""
        if self.builder is not None:
            self.builder.submit(self._step + 1, torch.cat([mb.tokens for mb in micro]), new_sequence=False)
