"""`prescient demo`: the whole pipeline on the tiny reference model, every result under one folder.

    DIR/model                 the tiny reference MoE (Hugging Face directory + reference.json)
    DIR/traces/{train,validation}  router traces of stdlib-code
    DIR/predictor/sida.*      the SiDA hash function (causal), trained with `prescient train`
    DIR/evaluate.{json,png}   predictor recall on the held-out trace
    DIR/compare-caches.{json,png}  cache policies with and without SiDA prefetch
    DIR/generate.json         greedy generation through the offloading runtime, with its stats

Each step runs the same `prescient` command a user would, and is skipped when its output is
already there, so a second run is quick.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from prescient.atomic import write_json_atomic
from prescient.cli import run_command
from training.reference_model import build_reference_model
from training.tracing import trace_model

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DATASET = "stdlib-code"
TRACE_TOKENS = {"train": 300_000, "validation": 30_000}
TRAIN_LIMIT = "00:00:08:00"  # SiDA training wall-clock cap (dd:hh:mm:ss)
PROMPT = "def read_config(path):\n    "


def demo_steps(out: Path) -> list[tuple[str, Path | None, Callable[[], object]]]:
    """(name, output that marks it done, action) per step; steps whose command resumes or
    reuses its own output have no marker."""
    model, traces, sida = out / "model", out / "traces", out / "predictor" / "sida"
    train, val = traces / "train", traces / "validation"
    steps: list[tuple[str, Path | None, Callable[[], object]]] = [
        ("reference model", None, lambda: build_reference_model("tiny", model)),
    ]
    for split, tokens in TRACE_TOKENS.items():
        steps.append((f"trace {split}", None,
                      lambda split=split, tokens=tokens: trace_model(model, DATASET, traces / split, split=split,
                                                                     max_tokens=tokens)))
    steps += [
        ("train SiDA predictor", sida.with_suffix(".json"), lambda: run_command([
            # early stopping and checkpoint choice see a held-out tenth of the train trace, never
            # the validation trace the evaluation step reports on
            "train", "--config", str(CONFIGS / "predictor" / "sida.yaml"), "--data.trace_dir", str(train),
            "--trainer.default_root_dir", str(out / "predictor"),
            "--trainer.logger.init_args.save_dir", str(out / "predictor"), "--trainer.max_time", TRAIN_LIMIT,
            "--export", str(sida)])),
        ("evaluate predictors", out / "evaluate.json", lambda: run_command([
            "evaluate", "--trace", str(val), "--train-trace", str(train), "--model", str(model),
            "--predictors", f"sida={sida},corr,token,freq,lookahead,oracle",
            "--json", str(out / "evaluate.json"), "--plot", str(out / "evaluate.png")])),
        ("compare cache policies", out / "compare-caches.json", lambda: run_command([
            "compare-caches", "--trace", str(val), "--train-trace", str(train), "--predictor", str(sida),
            "--policies", "lru,lfu,fifo,mrs,static,belady", "--capacity", "0.25,0.5", "--batch-size", "1,8",
            "--json", str(out / "compare-caches.json"), "--plot", str(out / "compare-caches.png")])),
        ("generate through the offloading runtime", out / "generate.json", lambda: run_command([
            "generate", "--model", str(model), "--predictor", str(sida), "--policy", "mrs", "--budget", "0.5",
            "--prompt", PROMPT, "--max-new-tokens", "48", "--json", str(out / "generate.json")])),
    ]
    return steps


def run_demo(out: str | Path = "runs/demo") -> Path:
    out = Path(out)
    steps = demo_steps(out)
    started = time.time()
    timing = {"steps": [], "cpu_count": os.cpu_count(), "load_average_at_start": list(os.getloadavg())}
    for number, (name, done_marker, action) in enumerate(steps, start=1):
        if done_marker is not None and done_marker.exists():
            log.info("[%d/%d] %s: reusing %s", number, len(steps), name, done_marker)
            timing["steps"].append({"step": name, "reused": True})
            continue
        start = time.time()
        log.info("[%d/%d] %s ...", number, len(steps), name)
        action()
        log.info("[%d/%d] %s done in %.0f s", number, len(steps), name, time.time() - start)
        timing["steps"].append({"step": name, "reused": False, "seconds": round(time.time() - start, 1)})
    timing["total_seconds"] = round(time.time() - started, 1)
    write_json_atomic(out / f"demo-timing-{time.strftime('%Y%m%dT%H%M%S')}.json", timing)  # one per run: cold and cached both kept
    log.info("demo finished in %.0f s; everything is under %s", time.time() - started, out)
    return out
