"""`prescient demo`: the whole pipeline on the tiny reference model, every result under one folder.

    DIR/model                 the tiny reference MoE (Hugging Face directory + reference.json)
    DIR/traces/{train,validation}  router traces of stdlib-code
    DIR/traces/decode         a decode trace: the model's greedy continuations of training prompts
    DIR/hardware.json         this machine measured (`prescient profile-hw`): the simulator's clock
    DIR/predictor/sida.*      the SiDA hash function (causal) with forecast heads for the next
                              HORIZON tokens, trained with `prescient train`
    DIR/predictor/sida-decode-h8.*  the same hash function with DECODE_HORIZON forecast heads trained
                              on the decode trace: what the runtime serves (docs/tracing.md)
    DIR/evaluate.{json,png}   predictor recall on the held-out trace, per forecast horizon too
    DIR/compare-caches.{json,png}  cache policies with and without SiDA prefetch, learned eviction
                              among them, time-true on this machine's profile
    DIR/generate.json         generation through the offloading runtime with learned eviction, sampled
                              (seeded: SAMPLING) so that a small model's text does not loop

Each step calls the library function behind the `prescient` command a user would run, and is
skipped when its output is already there, so a second run is quick.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from experiments.compare_caches import compare_caches, plot_compare_caches
from experiments.evaluate import evaluate_predictors
from experiments.evaluate_plot import plot_evaluation
from experiments.timing_calibration import load_timing
from offload_runtime.engine.generate import Sampling, generate_offloaded
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.planning.hardware import measure_profile
from prescient.atomic import write_json_atomic, write_results
from prescient.traces import read_manifest
from training.predictor_cli import train_predictor
from training.reference_model import build_reference_model
from training.tracing import trace_model

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DATASET = "stdlib-code"
TRACE_TOKENS = {"train": 300_000, "validation": 30_000}
TRAIN_LIMIT = "00:00:03:00"  # SiDA training wall-clock cap (dd:hh:mm:ss); the reference model takes ~9 of the 15 minutes
PROMPT = "def read_config(path):\n    "
HORIZON = 2  # forecast heads: the experts of the next two tokens, what learned eviction ranks by
DECODE_TOKENS, DECODE_TRACE_TOKENS, DECODE_BATCH = 96, 230_000, 32  # the decode trace: 2 053 prompts of 16 tokens
DECODE_HORIZON = 8  # the decode predictor's forecast heads (docs/tracing.md#decode-traces: its measured gain)
POLICIES = ("lru", "lfu", "fifo", "mrs", "static", "belady", "learned-belady")
# greedy decoding of the tiny model loops ('#' lines); seeded nucleus sampling reads as code, and
# draws the same tokens through the runtime as from the plain model (offloading is exact)
SAMPLING = Sampling(seed=0, temperature=0.7, top_p=0.9)


def demo_steps(out: Path) -> list[tuple[str, Path | None, Callable[[], object]]]:
    """(name, output that marks it done, action) per step; steps whose command resumes or
    reuses its own output have no marker."""
    model, traces, sida = out / "model", out / "traces", out / "predictor" / "sida"
    train, val, hardware = traces / "train", traces / "validation", out / "hardware.json"
    decode, sida_decode = traces / "decode", out / "predictor" / f"sida-decode-h{DECODE_HORIZON}"
    logged = {"trainer.default_root_dir": out / "predictor", "trainer.logger.init_args.save_dir": out / "predictor",
              "trainer.max_time": TRAIN_LIMIT}
    steps: list[tuple[str, Path | None, Callable[[], object]]] = [
        ("reference model", None, lambda: build_reference_model("tiny", model)),
    ]
    for split, tokens in TRACE_TOKENS.items():
        steps.append((f"trace {split}", None,
                      lambda split=split, tokens=tokens: trace_model(model, DATASET, traces / split, split=split,
                                                                     max_tokens=tokens)))
    # early stopping and checkpoint choice see a held-out tenth of the train trace, never the
    # validation trace the evaluation step reports on
    steps += [
        ("profile this machine", hardware, lambda: measure_profile(out).save(hardware)),
        ("train SiDA predictor", sida.with_suffix(".json"), lambda: train_predictor(
            CONFIGS / "predictor" / "sida.yaml", train, sida, **logged, **{"model.horizon": HORIZON})),
        ("trace greedy continuations", None, lambda: trace_model(
            model, DATASET, decode, split="train", max_tokens=DECODE_TRACE_TOKENS, top_t=16, batch_size=DECODE_BATCH,
            decode_tokens=DECODE_TOKENS)),
        ("train SiDA on the decode trace", sida_decode.with_suffix(".json"), lambda: train_predictor(
            CONFIGS / "predictor" / "sida.yaml", decode, sida_decode, **logged, **{"model.horizon": DECODE_HORIZON})),
        ("evaluate predictors", out / "evaluate.json", lambda: write_results(
            evaluate_predictors(val, {"sida": sida, **dict.fromkeys(("corr", "token", "freq", "lookahead", "oracle"))},
                                model_dir=model, train_trace=train),
            out / "evaluate.json", out / "evaluate.png", plot_evaluation)),
        ("compare cache policies", out / "compare-caches.json", lambda: write_results(
            timed_cache_comparison(val, train, sida, model, hardware),
            out / "compare-caches.json", out / "compare-caches.png", plot_compare_caches)),
        ("generate through the offloading runtime", out / "generate.json", lambda: show_generation(
            generate_offloaded(model, PROMPT, 48, predictor=sida, sampling=SAMPLING,
                               options=RuntimeOptions(policy="learned-belady", budget=0.5)),
            out / "generate.json")),
    ]
    return steps


def timed_cache_comparison(val: Path, train: Path, sida: Path, model: Path, hardware: Path) -> dict:
    """`prescient compare-caches --timing DIR/hardware.json --model-config DIR/model`: every policy
    replayed on the simulator's clock of this machine (per-layer compute, expert bytes, disk
    bytes/s), so prefetch pays for the bytes it moves, as it does in the runtime."""
    calibration = load_timing(hardware, model_config=model, fingerprint=read_manifest(val).fingerprint)
    result = compare_caches(val, POLICIES, (0.25, 0.5), (1, 8), predictor=sida, train_trace=train,
                            timing=calibration.timing)
    result["timing_calibration"] = calibration.to_dict()
    return result


def show_generation(record: dict, path: Path) -> None:
    """Write the generation record and print the prompt with its completion."""
    write_results(record, path)
    log.info("completion through the offloading runtime, learned eviction, sampled (seed %d, temperature %g, "
             "top-p %g; %.1f tokens/s):\n%s%s", SAMPLING.seed, SAMPLING.temperature, SAMPLING.top_p,
             record["tokens_per_s"] or 0.0, record["prompt"], record["text"])


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
