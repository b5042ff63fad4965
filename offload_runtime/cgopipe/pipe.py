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

`overlap=False` is the baseline: the same runtime and budget decoding the micro-batches one after
another, each through every layer, loading experts on demand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from offload_runtime.cgopipe.batching import partition_requests
from offload_runtime.cgopipe.decoder_stack import DecoderStack, MicroBatchInputs
from offload_runtime.engine.hash_builder import HashBuilder
from offload_runtime.engine.runtime import OffloadRuntime
from predictor.base import ExpertPredictor
from prescient.errors import CapacityError, UnsupportedModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """One scheduled operation: `op` is "page" (weights of `layer` requested), "ffn" or
    "attention" (a half-layer of `micro_batch` at `layer`)."""

    step: int
    op: str
    layer: int
    micro_batch: int


@dataclass
class DecodeStats:
    requests: int = 0
    batches: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    generated_tokens: int = 0
    decode_tokens: int = 0  # rows × decode steps (the first token comes from prefill)
    late_tables: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def slots_needed(resident_per_layer: int, n_layers: int, n_experts: int) -> int:
    """Resident experts of every layer, plus two layers' streamed experts (the double buffer)."""
    return resident_per_layer * n_layers + 2 * (n_experts - resident_per_layer)


def budget_fraction(resident_fraction: float, n_layers: int, n_experts: int) -> float:
    """The `load_offloaded` budget (a fraction of all experts) that CGOPipe needs for r_w."""
    resident = round(resident_fraction * n_experts)
    return min(1.0, slots_needed(resident, n_layers, n_experts) / (n_layers * n_experts))


@dataclass
class _MicroBatch:
    requests: list[int]
    mask: torch.Tensor  # [b, t] 2-D attention mask so far (left padding = 0)
    cache: object
    tokens: torch.Tensor  # [b, 1] the newest tokens
    hidden: torch.Tensor | None = None
    inputs: MicroBatchInputs | None = None
    out: list[list[int]] = field(default_factory=list)


class CGOPipe:
    def __init__(self, model: nn.Module, resident_fraction: float, hot: Sequence[Sequence[float]] | None = None,
                 predictor: ExpertPredictor | None = None, overlap: bool = True,
                 attention_device: str | None = "cpu", record_events: bool = False) -> None:
        runtime: OffloadRuntime | None = getattr(model, "offload_runtime", None)
        if runtime is None:
            raise ValueError("CGOPipe needs a model from load_offloaded(...) (its experts offloaded)")
        if runtime.builder is not None:
            raise ValueError("load the model without a predictor; give it to CGOPipe, which hashes whole batches")
        self.model, self.runtime = model, runtime
        self.stack = DecoderStack(model, attention_device=attention_device)
        self.n_layers, self.n_experts = len(runtime.layers), runtime.n_experts
        if self.n_layers != len(self.stack.layers):
            raise UnsupportedModelError(
                f"{type(model).__name__} has {len(self.stack.layers)} decoder layers of which {self.n_layers} are "
                "MoE layers; CGOPipe pages each layer's experts in the next layer's turn, so it needs every "
                "decoder layer to be a MoE layer")
        resident = round(resident_fraction * self.n_experts)
        need = slots_needed(resident, self.n_layers, self.n_experts)
        if runtime.pool.num_slots < need:
            raise CapacityError(
                f"r_w={resident_fraction:g} keeps {resident} experts per layer resident and streams "
                f"{self.n_experts - resident} into a double buffer: {need} slots, but the runtime has "
                f"{runtime.pool.num_slots}; load it with budget={budget_fraction(resident_fraction, self.n_layers, self.n_experts):.6g}"
            )
        ranking = torch.as_tensor(hot, dtype=torch.float64) if hot is not None else \
            -torch.arange(self.n_experts, dtype=torch.float64).repeat(self.n_layers, 1)  # no data: by id
        self.hot_order = torch.argsort(-ranking, dim=-1, stable=True).tolist()  # per layer, hottest first
        self.resident = [set(order[:resident]) for order in self.hot_order]
        self.overlap = overlap
        self.events: list[Event] | None = [] if record_events else None
        self.stats = DecodeStats()
        if predictor is not None:
            runtime.fingerprint.require_same(predictor.meta.fingerprint, f"predictor {predictor.kind!r}")
        self.builder = HashBuilder(predictor) if predictor is not None else None
        self._step = 0
        self._priority = 0.0
        runtime.arrival_order = overlap
        runtime.pin_resident([(layer, e) for layer, experts in enumerate(self.resident) for e in sorted(experts)])
        self.stack.check_split()

    # -- public --------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, micro_batch_size: int,
                 n_micro: int, kv_tokens: int | None = None, pad_token_id: int = 0,
                 eos_token_id: int | Sequence[int] | None | str = "model") -> list[list[int]]:
        """Greedy continuations of `prompts`, decoded in batches of up to `n_micro` micro-batches
        of up to `micro_batch_size` requests: what `generate` gives for each request alone — up
        to `max_new_tokens` ids, ending at the first end-of-sequence id (default: the model's
        generation config; None: never end early). Finished rows keep decoding until their batch
        ends, as in batched `generate`."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        lengths = [len(p) for p in prompts]
        if any(n == 0 for n in lengths):
            raise ValueError("every prompt needs at least one token")
        if eos_token_id == "model":
            eos_token_id = self.model.generation_config.eos_token_id
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        outputs: list[list[int]] = [[] for _ in prompts]
        for batch in partition_requests(lengths, n_micro, micro_batch_size, max_new_tokens, kv_tokens):
            micro = [self._prefill([prompts[r] for r in requests], requests, pad_token_id) for requests in batch]
            self._hash([mb.tokens for mb in micro], prompts=[[prompts[r] for r in mb.requests] for mb in micro],
                       pad_token_id=pad_token_id)
            start = time.perf_counter()
            for _ in range(max_new_tokens - 1):
                if all(eos.intersection(row) for mb in micro for row in mb.out):
                    break
                self._decode_step(micro)
                self.stats.decode_tokens += sum(len(mb.requests) for mb in micro)
            self.stats.decode_seconds += time.perf_counter() - start
            for mb in micro:
                for row, request in enumerate(mb.requests):
                    outputs[request] = _until_eos(mb.out[row], eos)
            self.stats.batches += 1
        self.stats.requests += len(prompts)
        self.stats.generated_tokens += sum(len(out) for out in outputs)
        return outputs

    def close(self) -> None:
        """Stop the hash-building thread; the runtime goes back to computing experts in groups."""
        self.runtime.arrival_order = False
        if self.builder is not None:
            self.builder.close()

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, prompts: list[Sequence[int]], requests: list[int], pad_token_id: int) -> _MicroBatch:
        """One micro-batch's prompts, left-padded, through every layer (experts on demand)."""
        start = time.perf_counter()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        mb = _MicroBatch(requests, mask, self.stack.new_cache(), ids)
        hidden, inputs = self.stack.embed(ids, mask, mb.cache)
        for layer in range(self.n_layers):
            hidden = self.stack.ffn_half(layer, self.stack.attention_half(layer, hidden, inputs))
        mb.tokens = self.stack.logits(hidden).argmax(-1, keepdim=True).cpu()
        mb.out = [[int(t)] for t in mb.tokens[:, 0]]
        self.stats.prefill_seconds += time.perf_counter() - start
        return mb

    # -- decode --------------------------------------------------------------------------------

    def _decode_step(self, micro: list[_MicroBatch]) -> None:
        self._step += 1
        n = len(micro)
        units = [(layer, j) for layer in range(self.n_layers) for j in range(n)]
        if self.overlap:
            pages = self._pages(n)
            self._request(pages[0], 0, step_start=True)
            ahead = min(2, n)  # the attention of unit u+2 needs the FFN of unit u+2-n done
            for u in range(ahead):
                self._attention(micro, *units[u])
            for u, (layer, j) in enumerate(units):
                self._request(pages[(layer + 1) % self.n_layers], j)
                self._ffn(micro, layer, j)
                if u + ahead < len(units):
                    self._attention(micro, *units[u + ahead])
        else:
            for j in range(n):
                for layer in range(self.n_layers):
                    self._attention(micro, layer, j)
                    self._ffn(micro, layer, j)
        for j, mb in enumerate(micro):
            mb.tokens = self.stack.logits(mb.hidden).argmax(-1, keepdim=True).cpu()
            for row, token in enumerate(mb.tokens[:, 0].tolist()):
                mb.out[row].append(token)
        self._hash([mb.tokens for mb in micro])

    def _attention(self, micro: list[_MicroBatch], layer: int, j: int) -> None:
        mb = micro[j]
        if layer == 0:
            mb.mask = torch.cat([mb.mask, torch.ones_like(mb.tokens)], dim=1)
            mb.hidden, mb.inputs = self.stack.embed(mb.tokens, mb.mask, mb.cache)
        mb.hidden = self.stack.attention_half(layer, mb.hidden, mb.inputs)
        self._log("attention", layer, j)

    def _ffn(self, micro: list[_MicroBatch], layer: int, j: int) -> None:
        micro[j].hidden = self.stack.ffn_half(layer, micro[j].hidden)
        self._log("ffn", layer, j)

    def _pages(self, n: int) -> list[list[list[tuple[int, int]]]]:
        """Per layer, its streamed experts in `n` pages, hottest first (predicted for this step's
        tokens when the hash table is ready, else the static ranking)."""
        table = self.builder.poll(self._step) if self.builder is not None else None
        if self.builder is not None and table is None:
            self.stats.late_tables += 1
        pages = []
        for layer in range(self.n_layers):
            order = self.hot_order[layer]
            if table is not None:
                order = torch.argsort(-table.scores[layer], stable=True).tolist()
            streamed = [(layer, e) for e in order if e not in self.resident[layer]]
            pages.append([page.tolist() for page in np.array_split(np.array(streamed, dtype=np.int64).reshape(-1, 2), n)])
        return pages

    def _request(self, layer_pages: list[list[tuple[int, int]]], j: int, step_start: bool = False) -> None:
        """Request page `j` of a layer (at a step's start: all of its pages)."""
        keys = [tuple(key) for page in (layer_pages if step_start else layer_pages[j:j + 1]) for key in page]
        if not keys:
            return
        inserted = self.runtime.prefetch(keys, priority=self._priority)
        self._priority -= len(inserted)
        self._log("page", keys[0][0], -1 if step_start else j)

    def _hash(self, tokens: list[torch.Tensor], prompts: list[list[Sequence[int]]] | None = None,
              pad_token_id: int = 0) -> None:
        """Hand the predictor the ids its next table is for: every request's prompt after
        prefill (one left-padded [N, T] batch), then each step's new tokens ([N, 1])."""
        if self.builder is None:
            return
        if prompts is None:
            self.builder.submit(self._step + 1, torch.cat(tokens), new_sequence=False)
            return
        flat = [p for group in prompts for p in group]
        width = max(len(p) for p in flat)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in flat])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in flat])
        # the prompt's table is not used (prefill loads on demand); its state leads into the first step
        self.builder.submit(-1, ids, new_sequence=True, attention_mask=mask)
        self.builder.submit(self._step + 1, torch.cat(tokens), new_sequence=False)

    def _log(self, op: str, layer: int, j: int) -> None:
        if self.events is not None:
            self.events.append(Event(self._step, op, layer, j))

    def __enter__(self) -> "CGOPipe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """`tokens` up to and including the first end-of-sequence id."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens
