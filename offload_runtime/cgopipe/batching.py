"""Request batching for CGOPipe: MoE-Lightning's balanced partition (its Algorithm 2).

Requests are taken longest prompt first; each goes into the open micro-batch with the smallest
token sum, if that micro-batch's KV cache still fits the budget with it; a micro-batch that
reaches μ requests is closed. Requests that fit nowhere carry over to the next batch, and a
final flush closes the partial micro-batches (the paper's listing drops them).

One deviation, on purpose: the paper checks the budget against the sum of prompt lengths; our
micro-batches are left-padded to their longest prompt, so the check uses what the KV cache
really holds, requests × (longest prompt + generation length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prescient.errors import PrescientError


class BatchingError(PrescientError):
    """Requests cannot be batched: a KV budget below the longest request, or a bad size."""


@dataclass
class MicroBatch:
    requests: list[int] = field(default_factory=list)  # indices into the request list
    tokens: int = 0  # sum of their prompt lengths
    longest: int = 0  # the first request's prompt length (requests arrive longest first)

    def kv_tokens(self, gen_len: int, extra: int = 0, extra_len: int = 0) -> int:
        """KV-cache tokens with `extra` more requests whose prompts are `extra_len` long."""
        return (len(self.requests) + extra) * (max(self.longest, extra_len) + gen_len)


def min_kv_tokens(prompt_lens: Sequence[int], gen_len: int) -> int:
    """The smallest per-micro-batch KV budget that can hold every request alone."""
    return max(prompt_lens) + gen_len


def partition_requests(prompt_lens: Sequence[int], n_micro: int, micro_batch_size: int, gen_len: int,
                       kv_tokens: int | None = None) -> list[list[list[int]]]:
    """Batches of micro-batches of request indices. Each batch has at most `n_micro` micro-batches
    of at most `micro_batch_size` (μ) requests, each within `kv_tokens` KV-cache tokens (None:
    unbounded). Every request lands in exactly one micro-batch."""
    if n_micro < 1 or micro_batch_size < 1:
        raise BatchingError(f"need at least one micro-batch of at least one request, got "
                            f"{n_micro} micro-batches of {micro_batch_size}")
    if not prompt_lens:
        return []
    if kv_tokens is not None and kv_tokens < min_kv_tokens(prompt_lens, gen_len):
        raise BatchingError(
            f"a KV-cache budget of {kv_tokens} tokens per micro-batch cannot hold the longest request "
            f"({max(prompt_lens)} prompt + {gen_len} generated tokens); the minimum is "
            f"{min_kv_tokens(prompt_lens, gen_len)}"
        )
    queue = sorted(range(len(prompt_lens)), key=lambda i: -prompt_lens[i])  # stable: ties keep order
    batches = []
    while queue:
        batch, queue = _one_batch(queue, prompt_lens, n_micro, micro_batch_size, gen_len, kv_tokens)
        batches.append(batch)
    return batches


def _one_batch(queue: list[int], prompt_lens: Sequence[int], n_micro: int, mu: int, gen_len: int,
               kv_tokens: int | None) -> tuple[list[list[int]], list[int]]:
    open_batches = [MicroBatch() for _ in range(n_micro)]
    closed: list[list[int]] = []
    carried: list[int] = []
    for request in queue:
        if not open_batches:
            carried.append(request)
            continue
        target = min(open_batches, key=lambda mb: mb.tokens)  # first of the smallest: deterministic
        length = prompt_lens[request]
        if kv_tokens is not None and target.kv_tokens(gen_len, extra=1, extra_len=length) > kv_tokens:
            carried.append(request)
            continue
        target.requests.append(request)
        target.tokens += length
        target.longest = max(target.longest, length)
        if len(target.requests) == mu:
            closed.append(target.requests)
            open_batches.remove(target)
    closed += [mb.requests for mb in open_batches if mb.requests]  # the final flush
    return closed, carried
