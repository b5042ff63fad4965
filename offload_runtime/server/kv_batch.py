"""The running batch's KV cache: rows that join and leave between decode steps.

Each row is one sequence. Rows are left-padded to a common length: `valid[b, t]` says whether
column t of row b holds a real token. A decode step appends one column for every row; a prefill
of new sequences builds a second batch, and `merge` pads both to one length and stacks them;
`select` keeps some rows and drops the leading columns no row needs any more.

A row's real keys and values are those its sequence would have alone (the positions it is fed
are its own token counts, and padded columns are masked out of attention), so a sequence's tokens
do not depend on the other rows, up to floating-point rounding in the batched kernels.

`prefill_inputs` lays out a prefill whose rows may resume a cached prefix (`prefix_cache`): each
row's past KV right-aligned in the first columns, its new tokens right-aligned after them; the
padding between is masked like any other. `row` takes one row's real KV out, for the prefix cache.

Only transformers' `DynamicCache` made of full-attention `DynamicLayer`s is handled (every
decoder-only architecture the runtime supports uses it); anything else is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from offload_runtime.server.prefix_cache import Prefix
from prescient.errors import PrescientError


class UnsupportedCacheError(PrescientError):
    """The model's KV cache is not one the serving batch can pad, stack and split."""


class KVBatch:
    def __init__(self, cache: DynamicCache, valid: torch.Tensor) -> None:
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:
                raise UnsupportedCacheError(
                    f"the model's KV cache has a {type(layer).__name__} layer; serving batches only full-attention "
                    "DynamicLayer caches (no sliding-window or linear-attention layers)")
        self.cache, self.valid = cache, valid  # valid: [B, T] bool

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention mask ([B, T + 1]) and position ids ([B, 1]) of one new token per row."""
        ones = torch.ones(self.rows, 1, dtype=torch.bool, device=self.valid.device)
        mask = torch.cat([self.valid, ones], dim=1)
        positions = self.valid.sum(dim=1, keepdim=True)  # each row's own token count
        return mask.long(), positions

    def appended(self) -> None:
        """A decode step added one real column to every row."""
        self.valid = torch.cat([self.valid, torch.ones(self.rows, 1, dtype=torch.bool, device=self.valid.device)], 1)

    def select(self, rows: list[int]) -> None:
        """Keep `rows`, in that order; drop the leading columns that are padding in every kept row."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        used = self.valid.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.valid.shape[1]
        self.valid = self.valid[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def row(self, row: int, tokens: list[int]) -> Prefix:
        """Row `row`'s real keys and values (copies), as the prefix of `tokens` they hold."""
        columns = self.valid[row].nonzero().flatten()
        return Prefix(tuple(tokens[:len(columns)]),
                      tuple(layer.keys[row].index_select(1, columns) for layer in self.cache.layers),
                      tuple(layer.values[row].index_select(1, columns) for layer in self.cache.layers))

    def merge(self, other: "KVBatch") -> None:
        """Append `other`'s rows after this batch's, both left-padded to the longer length."""
        length = max(self.valid.shape[1], other.valid.shape[1])
        self.valid = torch.cat([_pad_left(self.valid, length, dim=1), _pad_left(other.valid, length, dim=1)], 0)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length, 2), _pad_left(theirs.keys, length, 2)], 0)
            mine.values = torch.cat([_pad_left(mine.values, length, 2), _pad_left(theirs.values, length, 2)], 0)


def prefill_inputs(new: list[list[int]], pasts: list[Prefix | None], pad_token_id: int,
                   config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache]:
    """A prefill of rows with new tokens `new` after cached `pasts` (None: from the start): the
    new ids ([B, N], left-padded), which columns are real ([B, P + N]: the pasts' P, then the
    new N), each new token's position (its own count of tokens before it), and the cache holding the pasts."""
    n = max(len(tokens) for tokens in new)
    p = max((len(past.tokens) for past in pasts if past is not None), default=0)
    ids = torch.full((len(new), n), pad_token_id, dtype=torch.long)
    valid = torch.zeros(len(new), p + n, dtype=torch.bool)
    for row, (tokens, past) in enumerate(zip(new, pasts, strict=True)):
        ids[row, n - len(tokens):] = torch.tensor(tokens)
        valid[row, p + n - len(tokens):] = True
        if past is not None:
            valid[row, p - len(past.tokens):p] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)[:, p:]
    cache = DynamicCache(config=config)
    if p:
        some = next(past for past in pasts if past is not None)
        for layer in range(len(some.keys)):
            empty = some.keys[layer][:, :0]
            keys = [_pad_left(past.keys[layer] if past else empty, p, 1) for past in pasts]
            values = [_pad_left(past.values[layer] if past else empty, p, 1) for past in pasts]
            cache.update(torch.stack(keys), torch.stack(values), layer)
    return ids, valid, positions, cache


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0]  # F.pad counts dimensions from the last
    return F.pad(tensor, pad)
