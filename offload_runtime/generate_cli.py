"""`prescient generate`: greedy generation through the offloading runtime; prints the text and
the runtime statistics, and writes them as JSON with `--json`.

Wired into `prescient.cli` with `add_parser(sub)` and the command `run`. Heavy imports (torch,
transformers) happen in `run`, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from prescient.atomic import write_json_atomic

log = logging.getLogger(__name__)


def parse_budget(text: str) -> float | int | str:
    """A fraction of all experts ("0.5", "1"), bytes ("1073741824"), or bytes with a unit
    ("512MiB", "2GB", read by `slots_for_budget`)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if "." in text or value <= 1 else int(value)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text with experts offloaded (greedy), print runtime stats")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--predictor", default=None, help="predictor artifact (NAME, NAME.json or NAME.safetensors)")
    p.add_argument("--policy", default="lru", help="cache policy: lru, lfu, fifo, mrs")
    p.add_argument("--budget", type=parse_budget, default=0.5,
                   help="expert memory: a fraction of all experts (0.5), bytes, or e.g. 512MiB")
    p.add_argument("--store", choices=("disk", "host"), default="disk", help="where the experts live")
    p.add_argument("--drop-page-cache", action="store_true", help="disk store: drop read pages from the page cache")
    p.add_argument("--device", default="cpu")
    p.add_argument("--transfer-workers", type=int, default=1, help="expert copies that run at once")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, metavar="OUT", help="write ids, text, stats and settings here")
    return p


class _Clock:
    """A generate() streamer that only notes when each put arrives: the prompt, then each token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())


def run(args: argparse.Namespace) -> dict:
    """Generate, print, write `--json`; returns the JSON record."""
    import torch

    from offload_runtime.loader import load_offloaded
    from prescient.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    model = load_offloaded(args.model, predictor=args.predictor, policy=args.policy, budget=args.budget,
                           store=args.store, drop_page_cache=args.drop_page_cache, device=args.device,
                           transfer_workers=args.transfer_workers)
    with model.offload_runtime as runtime:
        inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)
        clock = _Clock()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=clock,
                                 pad_token_id=tokenizer.pad_token_id)
        stats = runtime.stats()
    # a decoder's output repeats the prompt; an encoder-decoder's starts with the decoder start token
    first = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    token_ids = out[0, first:].tolist()
    # clock: prompt put (before prefill), one put per new token, end
    prefill_s = clock.times[1] - clock.times[0] if len(token_ids) else None
    decode_s = clock.times[len(token_ids)] - clock.times[1] if len(token_ids) > 1 else None
    record = {
        "settings": {"model": str(args.model), "predictor": args.predictor and str(args.predictor),
                     "policy": args.policy, "budget": args.budget, "store": args.store,
                     "drop_page_cache": args.drop_page_cache, "device": args.device,
                     "max_new_tokens": args.max_new_tokens},
        "prompt": args.prompt,
        "token_ids": token_ids,
        "text": tokenizer.decode(token_ids, skip_special_tokens=True),
        "stats": stats.to_dict(),
        "prefill_seconds": prefill_s,
        "tokens_per_s": (len(token_ids) - 1) / decode_s if decode_s else None,  # decode only
    }
    print(record["text"])
    print(_summary(record))
    if args.json:
        write_json_atomic(args.json, record)
        log.info("wrote %s", args.json)
    return record


def _summary(record: dict) -> str:
    s = record["stats"]
    speed = f"{record['tokens_per_s']:.1f} tokens/s" if record["tokens_per_s"] else "n/a (fewer than 2 new tokens)"
    return "\n".join([
        f"experts: {s['hits']} hits, {s['misses']} misses (hit rate {s['hit_rate']:.1%}) in {s['slots']} slots",
        f"prefetch: {s['prefetch_inserts']} inserted, accuracy {s['prefetch_accuracy']:.1%}, "
        f"{s['wasted_prefetches']} wasted",
        f"moved {s['bytes_moved'] / 2**20:.2f} MiB in {s['loads']} loads; stalled {s['stall_seconds']:.3f} s on loads",
        f"hash tables: {s['tables_on_time']} on time, {s['late_tables']} late",
        f"decode: {speed}",
    ])
