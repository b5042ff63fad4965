"""The whole pipeline on each MoE architecture of the installed transformers, built tiny.

For a family the offloading runtime serves exactly (`experiments.arch_support`), with a small
byte-level BPE tokenizer saved beside the tiny model:

1. trace: `training.tracing.trace_model` over a few hundred tokens of a small JSON corpus of
   standard-library source;
2. train: a small SiDA hash function through the LightningCLI entry (`training.predictor_cli.main`,
   `configs/predictor/sida.yaml` with small sizes, one epoch of a few steps), exported as an artifact;
3. evaluate: `experiments.evaluate.evaluate_predictors` scores it (and `freq`) on the trace;
4. serve: greedy generation through `load_offloaded(..., predictor=artifact)` at 0.5/MRS equals
   the plain model's, and every forward got a hash table (on time or late);

and, apart, CGOPipe batch decoding (r_w = 0.5, micro-batches of 2) equals each request generated
alone by the plain model, or CGOPipe refuses the model with its reason.

`pipeline_row` returns the two outcomes as one-line strings: "ok (...)" / "exact", or
"<stage> failed: <error>" / "refused: <reason>".
"""

from __future__ import annotations

import json
import logging
import math
import sysconfig
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from experiments.arch_support import Support, greedy, prompt_inputs
from experiments.evaluate import evaluate_predictors
from offload_runtime.cgopipe.pipe import CGOPipe, budget_fraction
from offload_runtime.engine.loader import load_offloaded
from prescient.arch_zoo import VOCAB, Family, moe_families, save_tiny_model
from prescient.errors import PrescientError
from prescient.loading import load_model
from prescient.traces import read_manifest
from training.tokenizer import train_byte_level_bpe
from training.tracing import trace_model

log = logging.getLogger(__name__)

SIDA_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "predictor" / "sida.yaml"
TRACE_TOKENS = 400
TOKENIZER_VOCAB = 320  # the 256-byte alphabet, 2 special tokens and a few merges: below the tiny vocab
_SOURCES = ("textwrap.py", "string.py", "bisect.py", "heapq.py")
CGOPIPE_PROMPTS = (5, 2, 7, 3)  # prompt lengths: two micro-batches of two, with left padding
CGOPIPE_NEW_TOKENS = 4


@dataclass(frozen=True)
class PipelineResult:
    pipeline: str  # "ok (...)" or "<stage> failed: ..."
    cgopipe: str  # "exact", "refused: ..." or "failed: ..."

    @property
    def pipeline_ok(self) -> bool:
        return self.pipeline.startswith("ok")

    @property
    def cgopipe_ok(self) -> bool:
        return self.cgopipe == "exact" or self.cgopipe.startswith("refused")


def _sources() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in _SOURCES]


def make_tokenizer():
    """The small byte-level BPE tokenizer every tiny model gets (ids below the tiny vocab)."""
    tokenizer = train_byte_level_bpe(_sources(), TOKENIZER_VOCAB)
    assert len(tokenizer) <= VOCAB
    return tokenizer


def make_corpus(path: str | Path) -> Path:
    """A JSON-lines corpus of standard-library source, 30-line chunks (split by row by `load_corpus`)."""
    path = Path(path)
    rows = []
    for text in _sources():
        lines = text.splitlines()
        rows += ["\n".join(lines[i:i + 30]) for i in range(0, len(lines), 30)]
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows if row.strip()))
    return path


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def train_sida(trace: Path, export: Path, run_dir: Path) -> Path:
    """A small SiDA hash function trained on `trace` through the LightningCLI entry, exported."""
    from training.predictor_cli import main  # Lightning: imported only when training

    main(["--config", str(SIDA_CONFIG), "--data.trace_dir", str(trace), "--trainer.default_root_dir", str(run_dir),
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary",
          "false", "--trainer.max_epochs", "1", "--model.sizes.compress_dim", "16", "--model.sizes.hidden_dim", "32",
          "--data.window", "12", "--data.batch_size", "8", "--export", str(export)])
    return export


def serve_with_predictor(path: Path, export: Path, encoder_decoder: bool) -> str:
    """Greedy generation with the hash function prefetching, against the plain model; '' if exact."""
    inputs = prompt_inputs(encoder_decoder)
    plain, _ = load_model(path, dtype=torch.float32)
    want = greedy(plain, inputs)
    model = load_offloaded(path, predictor=export, policy="mrs", budget=0.5)
    with model.runtime as runtime:
        got = greedy(model, inputs)
    stats = runtime.stats()
    if not torch.equal(got, want):
        return "tokens differ from the plain model's with the predictor prefetching"
    if stats.tables_on_time + stats.late_tables != stats.forwards:
        return (f"{stats.forwards} forwards but {stats.tables_on_time} on-time and {stats.late_tables} late "
                "hash tables")
    return ""


def check_cgopipe(path: Path) -> str:
    """CGOPipe (r_w = 0.5) against each request generated alone: 'exact', 'refused: ...' or 'failed: ...'."""
    plain, layers = load_model(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in CGOPIPE_PROMPTS]
    try:
        budget = budget_fraction(0.5, len(layers), max(layer.num_experts for layer in layers))
        model = load_offloaded(path, policy="fifo", budget=budget)
        with model.runtime, CGOPipe(model, 0.5) as pipe:
            got = pipe.generate(prompts, CGOPIPE_NEW_TOKENS, micro_batch_size=2, n_micro=2, eos_token_id=None)
    except PrescientError as exc:
        return f"refused: {str(exc).strip().splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - reported in the row: a bug of ours
        log.exception("CGOPipe failed on %s", path)
        return f"failed: {_one_line(exc)}"
    with torch.inference_mode():
        want = [plain.generate(torch.tensor([p]), max_new_tokens=CGOPIPE_NEW_TOKENS, min_new_tokens=CGOPIPE_NEW_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return "exact" if got == want else "failed: tokens differ from each request generated alone"


def pipeline_row(family: Family, workdir: str | Path, tokenizer, corpus: str | Path) -> PipelineResult:
    """Trace, train, evaluate and serve a SiDA hash function on the tiny `family`; and CGOPipe."""
    workdir = Path(workdir) / family.model_type
    stage = "build"
    try:
        path = save_tiny_model(family, workdir / "model")
        tokenizer.save_pretrained(path)
        stage = "trace"
        trace = trace_model(path, f"json:{corpus}", workdir / "trace", split="train", max_tokens=TRACE_TOKENS,
                            top_t=8, seq_len=24, batch_size=4)
        stage = "train"
        export = train_sida(trace, workdir / "sida", workdir / "run")
        meta = json.loads(export.with_suffix(".json").read_text())
        traced = read_manifest(trace).fingerprint.to_dict()
        if meta["kind"] != "sida" or meta["fingerprint"] != traced:
            raise AssertionError(f"the artifact is a {meta['kind']} of {meta['fingerprint']}, not a sida of {traced}")
        stage = "evaluate"
        scores = evaluate_predictors(trace, {"sida": export, "freq": None}, model_dir=path, batch_sizes=(1, 8))
        sida = scores["predictors"]["sida"]
        if not all(math.isfinite(sida[key]) and 0 <= sida[key] <= 1 for key in ("recall_at_k", "recall_at_2k")):
            raise AssertionError(f"recall out of [0, 1]: {sida['recall_at_k']}, {sida['recall_at_2k']}")
        stage = "serve"
        problem = serve_with_predictor(path, export, family.encoder_decoder)
        if problem:
            raise AssertionError(problem)
        pipeline = (f"ok ({scores['trace']['n_tokens']} tokens traced, SiDA recall@k {sida['recall_at_k']:.2f}, "
                    "exact served with it)")
    except PrescientError as exc:
        pipeline = f"{stage} refused: {str(exc).strip().splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - reported in the row: a bug of ours
        log.exception("%s: %s failed", family.model_type, stage)
        pipeline = f"{stage} failed: {_one_line(exc)}"
    return PipelineResult(pipeline, check_cgopipe(path) if stage != "build" else "")


def with_pipeline(rows: list[Support], workdir: str | Path | None = None) -> list[Support]:
    """`rows` with the pipeline and CGOPipe outcomes filled in for every exact family."""
    families = {f.model_type: f for f in moe_families()}
    tokenizer = make_tokenizer()
    out = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        corpus = make_corpus(Path(tmp) / "corpus.jsonl")
        for row in rows:
            if row.status == "exact":
                result = pipeline_row(families[row.family], tmp, tokenizer, corpus)
                row = replace(row, pipeline=result.pipeline, cgopipe=result.cgopipe)
            out.append(row)
    return out
