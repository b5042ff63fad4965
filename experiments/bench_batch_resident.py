"""The all-resident runs of `prescient bench-batch`: each request generated alone by the plain
model (the reference every schedule's output is checked against), and the whole batch in one
`generate` with every weight resident (or as accelerate dispatched the model)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def reference_outputs(model, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Each request generated alone by the plain, all-resident `model` (greedy)."""
    import torch

    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=gen_len, do_sample=False,
                               pad_token_id=model.config.pad_token_id)[0, len(p):].tolist() for p in prompts]


def measure_resident(model, prompts: list[list[int]], gen_len: int, reference: list[list[int]] | None = None,
                     read_bytes: Callable[[], int] | None = None) -> dict[str, Any]:
    """Plain batched greedy `generate` (left padding), all weights resident (or `model` as
    accelerate dispatched it): end to end, the time of `gen_len` new tokens; decode, that minus
    the time of one (prefill and the first token). With `reference`, "exact": each request's new
    tokens equal its reference (up to the reference's end); with `read_bytes` (a counter of bytes
    read so far), the bytes read per generated token over those two calls."""
    import torch

    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    count = read_bytes or (lambda: 0)

    def timed(new: int) -> tuple[float, int, list[list[int]]]:
        before, start = count(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start, count() - before, out[:, width:].tolist()

    timed(1)  # warm-up
    (first, first_read, _), (full, full_read, out) = timed(1), timed(gen_len)
    run = {"decode_seconds": round(full - first, 4), "prefill_seconds": round(first, 4),
           "decode_tokens_per_s": len(prompts) * (gen_len - 1) / (full - first),
           "tokens_per_s": len(prompts) * gen_len / full}
    if reference is not None:
        run["exact"] = all(o[:len(r)] == r for o, r in zip(out, reference, strict=True))
    if read_bytes is not None:
        run["read_bytes_per_token"] = full_read / (len(prompts) * gen_len)
        run["decode_read_bytes_per_token"] = (full_read - first_read) / max(len(prompts) * (gen_len - 1), 1)
    return run
