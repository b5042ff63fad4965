"""FlexGen's zig-zag block schedule, and what every batch schedule here builds on.

A batch of requests decodes together in micro-batches (`batching.partition_requests`). A
fraction r_w of each layer's experts — the hottest — stays resident for good; the rest of a
layer passes through a region that holds two layers' worth (the `ExpertCache` with the FIFO
policy and the resident experts pinned). FlexGen's zig-zag order goes layer by layer and, inside
a layer, micro-batch by micro-batch (a "block" of micro-batches shares each layer's weights):

    request every streamed expert of layer i+1 (the transfer thread copies them meanwhile)
    for each micro-batch j: attention half of (i, j), then FFN half of (i, j)

The prefill runs the same order over the prompts (so each layer's experts cross the link once
per batch there too). FlexGen waits for all of layer i+1's weights before it computes layer i+1;
here a micro-batch waits only for the experts it selected (`OffloadRuntime.arriving`), which is
kinder to the baseline.

`ZigZagDecoder` owns the request loop (prefill, decode steps, end of sequence, statistics, the
slots and resident experts); CGOPipe (`pipe.py`) and Klotski (`klotski.py`) change its decode
step, what a layer requests ahead, and how its experts compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from offload_runtime.cgopipe.batching import partition_requests
from offload_runtime.cgopipe.decoder_stack import DecoderStack, MicroBatchInputs
from offload_runtime.engine.loaded import LoadedModel
from offload_runtime.engine.runtime import OffloadRuntime
from prescient.errors import CapacityError, UnsupportedModelError


@dataclass(frozen=True)
class Event:
    """One scheduled operation: `op` is "page" (weights of `layer` requested), "ffn" or
    "attention" (a half-layer of `micro_batch` at `layer`); Klotski adds "moe" (the layer's
    experts over every micro-batch's tokens, micro_batch -1)."""

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
    decode_bytes: int = 0  # expert bytes the runtime moved during decode steps
    late_tables: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """End to end: every generated token (the prefill's first ones too) over prefill + decode."""
        seconds = self.prefill_seconds + self.decode_seconds
        return self.generated_tokens / seconds if seconds else 0.0


def slots_needed(resident_per_layer: int, n_layers: int, n_experts: int) -> int:
    """Resident experts of every layer, plus two layers' streamed experts (the double buffer)."""
    return resident_per_layer * n_layers + 2 * (n_experts - resident_per_layer)


def budget_fraction(resident_fraction: float, n_layers: int, n_experts: int) -> float:
    """The `load_offloaded` budget (a fraction of all experts) that r_w needs."""
    resident = round(resident_fraction * n_experts)
    return min(1.0, slots_needed(resident, n_layers, n_experts) / (n_layers * n_experts))


@dataclass
class MicroBatch:
    requests: list[int]
    mask: torch.Tensor  # [b, t] 2-D attention mask so far (left padding = 0)
    cache: object
    tokens: torch.Tensor  # [b, t] the prompt, then [b, 1] the newest tokens
    hidden: torch.Tensor | None = None
    inputs: MicroBatchInputs | None = None
    out: list[list[int]] = field(default_factory=list)


class ZigZagDecoder:
    """Batch decoding in FlexGen's zig-zag order (see the module doc). `arrival_order`: the
    runtime computes a layer's resident experts first, then each copy as it lands (Klotski's
    order, which CGOPipe and Klotski use); FlexGen computes in the model's order."""

    def __init__(self, model: LoadedModel, resident_fraction: float, hot: Sequence[Sequence[float]] | None = None,
                 attention_device: str | None = "cpu", record_events: bool = False,
                 arrival_order: bool = False) -> None:
        runtime = model.runtime if isinstance(model, LoadedModel) else None
        if not isinstance(runtime, OffloadRuntime):
            raise ValueError(f"{type(self).__name__} needs a model from load_offloaded(...) (its experts offloaded)")
        if runtime.builder is not None:
            raise ValueError("load the model without a predictor; give it to the batch decoder, which hashes whole "
                             "batches")
        self.model, self.runtime = model, runtime
        self.stack = DecoderStack(model.module, attention_device=attention_device)
        self.n_layers, self.n_experts = len(runtime.layers), runtime.n_experts
        if self.n_layers != len(self.stack.layers):
            raise UnsupportedModelError(
                f"{type(model).__name__} has {len(self.stack.layers)} decoder layers of which {self.n_layers} are "
                "MoE layers; batch decoding requests each layer's experts in the previous layer's turn, so it needs "
                "every decoder layer to be a MoE layer")
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
        self.events: list[Event] | None = [] if record_events else None
        self.stats = DecodeStats()
        self._step = 0
        self._prefilling = False
        self._priority = 0.0
        self._order = ExitStack()  # the runtime's own order, given back by close()
        self._order.enter_context(runtime.pipelining(arrival_order))
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
            micro = self._prefill([[prompts[r] for r in requests] for requests in batch], batch, pad_token_id)
            start, moved = time.perf_counter(), self.runtime.stats().bytes_moved
            for _ in range(max_new_tokens - 1):
                if all(eos.intersection(row) for mb in micro for row in mb.out):
                    break
                self._step += 1
                self._decode_step(micro)
                self._next_tokens(micro)
                self._step_done(micro)
                self.stats.decode_tokens += sum(len(mb.requests) for mb in micro)
            self.stats.decode_seconds += time.perf_counter() - start
            self.stats.decode_bytes += self.runtime.stats().bytes_moved - moved
            for mb in micro:
                for row, request in enumerate(mb.requests):
                    outputs[request] = _until_eos(mb.out[row], eos)
            self.stats.batches += 1
        self.stats.requests += len(prompts)
        self.stats.generated_tokens += sum(len(out) for out in outputs)
        return outputs

    def close(self) -> None:
        """The runtime goes back to computing experts in the order it had before."""
        self._order.close()

    def __enter__(self) -> "ZigZagDecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[Sequence[int]]], batch: list[list[int]], pad_token_id: int) -> list[MicroBatch]:
        """Each micro-batch's prompts, left-padded, through every layer in the zig-zag order."""
        start = time.perf_counter()
        micro = []
        for group, requests in zip(prompts, batch):
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            mb = MicroBatch(requests, mask, self.stack.new_cache(), ids)
            mb.hidden, mb.inputs = self.stack.embed(ids, mask, mb.cache)
            micro.append(mb)
        self._prefilling = True  # events are a decode step's only
        for layer in range(self.n_layers):
            self._layer(micro, layer)
        self._prefilling = False
        for mb in micro:
            mb.tokens = self.stack.logits(mb.hidden).argmax(-1, keepdim=True).cpu()
            mb.out = [[int(t)] for t in mb.tokens[:, 0]]
        self._prefilled(micro, prompts, pad_token_id)
        self.stats.prefill_seconds += time.perf_counter() - start
        return micro

    # -- the schedule (what CGOPipe and Klotski change) ----------------------------------------

    def _prefilled(self, micro: list[MicroBatch], prompts: list[list[Sequence[int]]], pad_token_id: int) -> None:
        """A batch's prefill is done: its first tokens are in `micro`."""

    def _step_done(self, micro: list[MicroBatch]) -> None:
        """A decode step is done: its new tokens are in `micro`."""

    def _decode_step(self, micro: list[MicroBatch]) -> None:
        for mb in micro:
            self._embed_step(mb)
        for layer in range(self.n_layers):
            self._layer(micro, layer)

    def _layer(self, micro: list[MicroBatch], layer: int) -> None:
        """One layer of the block: what it requests ahead, every micro-batch's attention half,
        then its experts."""
        self._request_ahead(micro, layer)
        for j in range(len(micro)):
            self._attention(micro, layer, j)
        self._experts(micro, layer)

    def _request_ahead(self, micro: list[MicroBatch], layer: int) -> None:
        """FlexGen: layer+1's streamed experts while layer computes (at the first layer, its own too)."""
        if layer == 0:
            self._request(self._streamed(0))
        self._request(self._streamed((layer + 1) % self.n_layers))

    def _experts(self, micro: list[MicroBatch], layer: int) -> None:
        """FlexGen: the FFN half of each micro-batch in turn (the attention ran before: zig-zag
        inside the layer)."""
        for j in range(len(micro)):
            self._ffn(micro, layer, j)

    # -- shared steps ----------------------------------------------------------------------------

    def _next_tokens(self, micro: list[MicroBatch]) -> None:
        for mb in micro:
            mb.tokens = self.stack.logits(mb.hidden).argmax(-1, keepdim=True).cpu()
            for row, token in enumerate(mb.tokens[:, 0].tolist()):
                mb.out[row].append(token)

    def _embed_step(self, mb: MicroBatch) -> None:
        """A decode step's new tokens of `mb`: its mask grows by one, its hidden states start."""
        mb.mask = torch.cat([mb.mask, torch.ones_like(mb.tokens)], dim=1)
        mb.hidden, mb.inputs = self.stack.embed(mb.tokens, mb.mask, mb.cache)

    def _attention(self, micro: list[MicroBatch], layer: int, j: int) -> None:
        micro[j].hidden = self.stack.attention_half(layer, micro[j].hidden, micro[j].inputs)
        self._log("attention", layer, j)

    def _ffn(self, micro: list[MicroBatch], layer: int, j: int) -> None:
        micro[j].hidden = self.stack.ffn_half(layer, micro[j].hidden)
        self._log("ffn", layer, j)

    def _streamed(self, layer: int, order: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """`layer`'s experts that are not resident for good, in `order` (default: hottest first)."""
        return [(layer, e) for e in (order or self.hot_order[layer]) if e not in self.resident[layer]]

    def _request(self, keys: list[tuple[int, int]], j: int = -1) -> None:
        """Prefetch `keys` in order, after everything requested before (demand loads go first)."""
        if not keys:
            return
        inserted = self.runtime.prefetch(keys, priority=self._priority)
        self._priority -= len(inserted)
        self._log("page", keys[0][0], j)

    def _log(self, op: str, layer: int, j: int) -> None:
        if self.events is not None and not self._prefilling:
            self.events.append(Event(self._step, op, layer, j))


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """`tokens` up to and including the first end-of-sequence id."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens
