"""A replica's prefix KV cache: the keys and values of recently finished sequences, by token ids.

A request whose prompt starts with tokens a finished sequence already ran through the model
prefills only the rest, on that sequence's KV (sliced to the common prefix). A chat's next turn
resends the conversation so far, so on the replica that served its last turn it prefills only the
new message (vLLM's automatic prefix caching and SGLang's radix cache do the same, in blocks or a
token tree over a paged KV pool; here a few whole sequences are enough).

Matching is token by token, so a re-tokenised answer that differs from the generated ids still
matches up to where they part. At least one prompt token is always left to prefill: its logits give
the first sampled token. Bounded by entries and bytes, least recently used first; a stored sequence
replaces any entry it extends (the last turn of the same conversation).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Prefix:
    """A sequence's KV: per layer, keys and values of shape [kv heads, tokens, head dim]."""

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def head(self, length: int) -> "Prefix":
        """Its first `length` tokens (views, no copy)."""
        return Prefix(self.tokens[:length], tuple(k[:, :length] for k in self.keys),
                      tuple(v[:, :length] for v in self.values))


class PrefixCache:
    def __init__(self, max_bytes: int, max_entries: int = 64) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()  # least recently used first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> Prefix | None:
        """The longest cached prefix of `prompt` (its last token excluded), or None."""
        best, length = None, 0
        for entry in self._entries.values():
            common = _common_prefix(entry.tokens, prompt, len(prompt) - 1)
            if common > length:
                best, length = entry, common
        if best is None:
            return None
        self._entries.move_to_end(best.tokens)
        return best.head(length)

    def store(self, prefix: Prefix) -> None:
        """Keep `prefix` (contiguous tensors it alone holds); drop the entries it extends, then the
        least recently used while over the bounds. One larger than the byte bound is not kept."""
        if not prefix.tokens or prefix.nbytes > self.max_bytes:
            return
        for tokens in [t for t in self._entries if prefix.tokens[:len(t)] == t]:
            self._drop(tokens)
        self._entries[prefix.tokens] = prefix
        self.bytes += prefix.nbytes
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self.bytes -= self._entries.pop(tokens).nbytes


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
