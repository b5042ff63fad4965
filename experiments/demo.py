"""`prescient demo`: the whole pipeline on the tiny reference model, every result under one folder.

    DIR/model            the tiny reference MoE (Hugging Face directory)
    DIR/traces/train     router traces of its training split (predictor training data)
    DIR/traces/validation  router traces of the held-out split
Each step reuses its output when it is already there, so a second run is quick.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from training.reference_model import build_reference_model
from training.tracing import trace_model

log = logging.getLogger(__name__)

DATASET = "stdlib-code"
TRACE_TOKENS = {"train": 100_000, "validation": 30_000}


def run_demo(out: str | Path = "runs/demo") -> Path:
    out = Path(out)
    steps = [
        ("reference model", lambda: build_reference_model("tiny", out / "model")),
        *[
            (f"trace {split}", lambda split=split: trace_model(
                out / "model", DATASET, out / "traces" / split, split=split, max_tokens=tokens))
            for split, tokens in TRACE_TOKENS.items()
        ],
    ]
    for number, (name, step) in enumerate(steps, start=1):
        start = time.time()
        log.info("[%d/%d] %s ...", number, len(steps), name)
        result = step()
        log.info("[%d/%d] %s done in %.0f s -> %s", number, len(steps), name, time.time() - start, result)
    log.info("demo finished; everything is under %s", out)
    return out
