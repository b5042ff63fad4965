"""The file-backed pages a decoded token runs: what a memory plan must keep resident beside its
anonymous memory, measured (`prescient.memory_cap.HOT_LIBRARY_BYTES` is set from it).

    python -m experiments.code_pages --model runs/tb [--predictor P] [--memory 0.85GB] --json out.json

After the prefill and `--settle` tokens, the kernel's referenced bits are cleared
(`/proc/self/clear_refs`); after `--tokens` more, `/proc/self/smaps` says which file-backed pages
were touched since (`Referenced`), per file: the libraries' code and data every token runs. Slots
and the KV cache are anonymous and not counted; nor is the checkpoint, which the store reads with
pread (no mapping).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

KIB = 1024


def referenced_file_bytes() -> dict[str, int]:
    """Per mapped file: bytes of its pages referenced since the bits were last cleared."""
    out: dict[str, int] = defaultdict(int)
    path = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
            path = head[5] if len(head) >= 6 and head[5].startswith("/") else None
        elif path and head[0] == "Referenced:":
            out[path] += int(head[1]) * KIB
    return dict(out)


class ClearAfter:
    """A generate() streamer that clears the referenced bits once `after` puts have arrived."""

    def __init__(self, after: int) -> None:
        self.after, self.puts = after, 0

    def put(self, _value: Any) -> None:
        self.puts += 1
        if self.puts == self.after:
            Path("/proc/self/clear_refs").write_text("1")

    def end(self) -> None:
        pass


def measure(model_dir: str, predictor: str | None, memory: str | None, settle: int, tokens: int) -> dict:
    import torch

    from offload_runtime.engine.loader import load_offloaded
    from prescient.model_dir import ModelDirectory

    torch.set_num_threads(1)
    directory = ModelDirectory.open(model_dir)
    tokenizer = directory.tokenizer()
    inputs = tokenizer("def read_config(path):\n", return_tensors="pt")
    options = {"memory": memory} if memory else {}
    model = load_offloaded(directory, predictor, **options)
    with model.runtime, torch.inference_mode():
        model.generate(**inputs, max_new_tokens=settle + tokens, min_new_tokens=settle + tokens, do_sample=False,
                       streamer=ClearAfter(settle + 2), pad_token_id=tokenizer.pad_token_id)
        touched = referenced_file_bytes()
    top = sorted(touched.items(), key=lambda item: -item[1])
    return {"model": model_dir, "predictor": predictor, "memory": memory, "settle_tokens": settle,
            "tokens": tokens, "referenced_file_bytes": sum(touched.values()),
            "by_file": [{"file": name, "bytes": size} for name, size in top[:25]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--predictor")
    parser.add_argument("--memory")
    parser.add_argument("--settle", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    record = measure(args.model, args.predictor, args.memory, args.settle, args.tokens)
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"{record['referenced_file_bytes'] / 2**20:.1f} MiB of file-backed pages touched over {args.tokens} tokens")


if __name__ == "__main__":
    main()
