"""`prescient trace`: record router traces of an MoE model over a dataset.

Text is tokenized per document and cut into windows of `seq_len` tokens; windows are
batched with right padding, and only real tokens become rows. Every `shard_sequences`
windows make one shard (see `prescient.traces` for the format). A rerun with the same
settings resumes after the last complete shard, with the same batches, so its rows are
those of an uninterrupted run.

An encoder-decoder (Switch Transformers) reads the window with its encoder, and the decoder
start token followed by the window with its decoder. A row's encoder and decoder layers are
both those of the step that reads the row's token (the decoder's step on the start token is
not a row), so a predictor fed a token stream learns one thing for both: what the layers
reading a token pick. When serving, the encoder stream is the prompt and the decoder stream the
start token and then each generated token. The manifest says so in `settings["decoder_reads_row_token"]`.

With `decode_tokens`, a *decode trace*: each window's first `prompt_tokens` tokens are a prompt, and
the trace holds the prompt followed by the model's own greedy continuation of `decode_tokens` tokens
(cut after an end-of-sequence token), routed as the runtime routes them when it decodes that prompt.
A predictor trained on it learns the routing it is asked about while serving: greedy decoding
repeats itself where the corpus's text does not (docs/tracing.md#decode-traces has what that is worth).

With `hidden_states`, each MoE layer's block input (what its router reads) is kept per row too,
in bfloat16 (`prescient.traces`' `hidden` column), for the hidden-state probe (`predictor.probe`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from predictor.lookahead import recording_block_inputs
from prescient.arch import MoELayer, is_encoder_decoder
from prescient.errors import TraceError
from prescient.fingerprint import ModelFingerprint, loaded_fingerprint
from prescient.loading import load_model, load_tokenizer
from prescient.traces import HIDDEN, HIDDEN_DTYPE, MANIFEST, TraceManifest, TraceWriter, read_manifest
from training.corpora import load_corpus
from training.router_hooks import RouterRecorder

log = logging.getLogger(__name__)


def token_windows(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Windows of at most `seq_len` token ids, document by document, `max_tokens` in all."""
    left = max_tokens
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len][:left]
            if window:
                yield window
                left -= len(window)
            if left <= 0:
                return


def prompt_windows(windows: Iterable[list[int]], prompt_tokens: int) -> Iterator[list[int]]:
    """Each window's first `prompt_tokens` ids (a window shorter than that is skipped)."""
    return (window[:prompt_tokens] for window in windows if len(window) >= prompt_tokens)


@torch.no_grad()
def greedy_continuations(model, prompts: Iterable[list[int]], new_tokens: int, batch_size: int,
                         eos_id: int | None, pad_id: int, progress: tqdm | None = None) -> Iterator[list[int]]:
    """Each prompt (all of one length) followed by `model`'s greedy continuation of `new_tokens`
    ids, cut after its first `eos_id`: `batch_size` prompts per `generate` (`progress` counts them)."""
    prompts = iter(prompts)
    while batch := list(islice(prompts, batch_size)):
        if progress is not None:
            progress.update(len(batch))
        ids = torch.tensor(batch, dtype=torch.long)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)
        for prompt, row in zip(batch, out.tolist()):
            continuation = row[len(prompt):]
            if eos_id is not None and eos_id in continuation:
                continuation = continuation[: continuation.index(eos_id) + 1]
            yield prompt + continuation
    if progress is not None:
        progress.close()


def pad_batch(windows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [B, S], right-padded to the longest window."""
    width = max(len(w) for w in windows)
    ids = torch.tensor([w + [pad_id] * (width - len(w)) for w in windows], dtype=torch.long)
    lengths = torch.tensor([len(w) for w in windows])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids, mask


def decoder_start_id(config) -> int:
    """The decoder start token; older Switch/T5 configs leave it out and start with pad."""
    start = getattr(config, "decoder_start_token_id", None)
    start = config.pad_token_id if start is None else start
    if start is None:
        raise TraceError("the encoder-decoder config sets neither decoder_start_token_id nor pad_token_id")
    return int(start)


def model_inputs(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Forward kwargs; an encoder-decoder's decoder reads the start token, then the same text."""
    inputs = {"input_ids": ids, "attention_mask": mask}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = 1  # a trace reads the routers only: not every position's logits (0.4 GB in
        # float32 for a batch of 2 048 tokens over a 50k vocabulary, beyond what a --memory plan reserves)
    if is_encoder_decoder(model):
        start = torch.full_like(ids[:, :1], decoder_start_id(model.config))
        inputs["decoder_input_ids"] = torch.cat([start, ids], dim=1)
        inputs["decoder_attention_mask"] = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
    return inputs


def rows_of_batch(ids, mask, logits, selected, first_seq: int, top_t: int,
                  hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Trace columns for the real (unpadded) tokens of one batch.

    `logits` [B, S, L, E] and `selected` [B, S, L, k] come from `RouterRecorder.stacked`;
    `hidden` [B, S, L, H], the block inputs, adds the `hidden` column.
    """
    width = ids.shape[1]
    real = mask.flatten().nonzero().squeeze(1)  # flat positions of the real tokens, in row order
    logits = logits.flatten(0, 1).index_select(0, real)  # [N, L, E]
    chosen = selected.flatten(0, 1).index_select(0, real)  # [N, L, k]
    ranked_logits, ranked_ids = logits.sort(dim=-1, descending=True)  # faster than topk for small E
    order = logits.gather(-1, chosen).argsort(dim=-1, descending=True)  # the router's choice, best first
    columns = {} if hidden is None else {HIDDEN: hidden.flatten(0, 1).index_select(0, real).to(HIDDEN_DTYPE)}
    return {
        **columns,
        "seq_id": real // width + first_seq,
        "position": (real % width).to(torch.int32),
        "token_id": ids.flatten().index_select(0, real),
        "topk_ids": chosen.gather(-1, order).to(torch.int16),
        "topt_ids": ranked_ids[..., :top_t].to(torch.int16),
        "topt_logits": ranked_logits[..., :top_t].to(torch.float32),
    }


def stacked_inputs(seen: dict[int, torch.Tensor], n_layers: int, batch: int, seq: int) -> torch.Tensor:
    """[B, S, L, H] block inputs of the last forward: each layer's last S positions (as
    `RouterRecorder.stacked`)."""
    return torch.stack([seen[i].reshape(batch, -1, seen[i].shape[-1])[:, -seq:] for i in range(n_layers)], dim=2)


@torch.no_grad()
def trace_windows(model, layers: list[MoELayer], windows: Iterable[list[int]], writer: TraceWriter, *,
                  pad_id: int, top_t: int, batch_size: int, shard_sequences: int, first_seq: int = 0,
                  progress: tqdm | None = None) -> None:
    """Run `model` over `windows` and append one shard to `writer` per `shard_sequences` windows
    (with the hidden column when the writer's manifest has one)."""
    windows = iter(windows)
    recorder = RouterRecorder(layers)
    seq = first_seq
    hidden = bool(writer.manifest.hidden_size)
    with recorder.recording(), recording_block_inputs(layers if hidden else []) as seen:
        while chunk := list(islice(windows, shard_sequences)):
            parts: list[dict[str, torch.Tensor]] = []
            for start in range(0, len(chunk), batch_size):
                ids, mask = pad_batch(chunk[start : start + batch_size], pad_id)
                model(**model_inputs(model, ids, mask))
                logits, selected = recorder.stacked(*ids.shape)
                inputs = stacked_inputs(seen, len(layers), *ids.shape) if hidden else None
                parts.append(rows_of_batch(ids, mask, logits, selected, seq + start, top_t, inputs))
                if progress is not None:
                    progress.update(int(mask.sum()))
            writer.add_shard({k: torch.cat([p[k] for p in parts]) for k in parts[0]}, sequences=len(chunk))
            seq += len(chunk)


def _resume_point(out: Path, manifest: TraceManifest) -> TraceManifest | None:
    """The existing manifest to continue, or None to start a new trace."""
    if out.exists() and not out.is_dir():
        raise TraceError(f"{out} is a file, not a folder; choose another --out")
    old = read_manifest(out)
    if old is None:
        if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):
            raise TraceError(f"{out} exists and is not a trace directory (no {MANIFEST}); choose another --out")
        return None
    differ = [
        f"{what}: {a!r} there, {b!r} now"
        for what, a, b in [
            ("fingerprint", str(old.fingerprint), str(manifest.fingerprint)),
            ("dataset", old.dataset, manifest.dataset),
            ("split", old.split, manifest.split),
            ("top_t", old.top_t, manifest.top_t),
            ("hidden_states", old.hidden_size, manifest.hidden_size),
            *((key, old.settings.get(key), manifest.settings.get(key))
              for key in sorted(set(old.settings) | set(manifest.settings)) if key != "model"),  # by fingerprint
        ]
        if a != b
    ]
    if differ:
        raise TraceError(f"{out} already holds a trace made with other settings ({'; '.join(differ)}); "
                         "choose another --out or delete it")
    for shard in old.shards:
        if not (out / shard["file"]).exists():
            raise TraceError(f"{out} lists shard {shard['file']} that is missing; delete {out} and trace again")
    return old


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if type(value) is not int or value < 1:
            raise TraceError(f"{name} is {value!r}; it must be a whole number of at least 1")


def _model_name(model_dir: str | Path) -> str:
    """What the manifest records as the model: a local directory's absolute path (training reads
    it from anywhere), or the hub name."""
    return str(Path(model_dir).resolve()) if Path(model_dir).exists() else str(model_dir)


def _hidden_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    size = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    if not size:
        raise TraceError(f"{model.config.model_type}: the config names no hidden_size; cannot trace hidden states")
    return int(size)


def _traced_model(model_dir: str | Path, dtype: torch.dtype,
                  model: nn.Module | None) -> tuple[nn.Module, list[MoELayer], ModelFingerprint]:
    """(model, its MoE layers, the fingerprint of `model_dir`): `model` as given, loaded through the
    offloading runtime (a `LoadedModel`, whose `runtime` knows the layers and the fingerprint), or the whole
    model loaded here in `dtype`."""
    if model is not None:
        return model, model.runtime.layers, model.runtime.fingerprint
    model, layers = load_model(model_dir, dtype=dtype)
    return model, layers, loaded_fingerprint(model_dir, model, layers, dtype)


def trace_model(model_dir: str | Path, dataset: str, out: str | Path, split: str = "validation",
                max_tokens: int = 50_000, top_t: int = 30, text_field: str = "text", seq_len: int = 128,
                batch_size: int = 16, shard_sequences: int = 256, hidden_states: bool = False,
                dtype: torch.dtype = torch.float32, model: nn.Module | None = None,
                decode_tokens: int | None = None, prompt_tokens: int = 16) -> Path:
    """Trace `model_dir` over `dataset`'s split into `out`; resumes an interrupted run.
    `hidden_states`: keep each MoE layer's block input per row too (bfloat16). The model computes
    in `dtype` (a trace in another dtype than float32 records it in its settings); `model`, when
    given, is `model_dir` already loaded in `dtype` through the offloading runtime
    (`offload_runtime.engine.loader.load_offloaded`), which routes exactly as the whole model does,
    so the trace is the one the whole model writes, in less memory. `decode_tokens`: a decode trace
    (the module's doc) of prompts of `prompt_tokens` tokens, one from each window, `max_tokens`
    traced tokens at most, the continuations made `batch_size` prompts at a time."""
    out = Path(out)
    _check_sizes(max_tokens=max_tokens, top_t=top_t, seq_len=seq_len, batch_size=batch_size,
                 shard_sequences=shard_sequences, **({} if decode_tokens is None else
                                                     {"decode_tokens": decode_tokens, "prompt_tokens": prompt_tokens}))
    model, layers, fingerprint = _traced_model(model_dir, dtype, model)
    if decode_tokens is not None and is_encoder_decoder(model):
        raise TraceError(f"{fingerprint.arch}: a decode trace needs a decoder-only model (an encoder-decoder's "
                         "continuation is its decoder's, not the prompt's stream)")
    tokenizer = load_tokenizer(model_dir)
    texts = load_corpus(dataset, split, text_field)["text"]
    manifest = TraceManifest(
        fingerprint=fingerprint, dataset=dataset, split=split, top_t=min(top_t, fingerprint.n_experts),
        settings={"model": _model_name(model_dir), "max_tokens": max_tokens, "seq_len": seq_len,
                  "shard_sequences": shard_sequences, "text_field": text_field,
                  **({} if dtype == torch.float32 else {"dtype": str(dtype).removeprefix("torch.")}),
                  **({"decoder_reads_row_token": True} if is_encoder_decoder(model) else {}),
                  **({} if decode_tokens is None else {"decode_tokens": decode_tokens, "prompt_tokens": prompt_tokens})},
        hidden_size=_hidden_size(model) if hidden_states else None,
    )
    previous = _resume_point(out, manifest)
    if previous is not None:  # the same model (by fingerprint), perhaps spelled another way: record where it is now
        previous.settings["model"] = manifest.settings["model"]
    if previous is not None and previous.complete:
        log.info("trace in %s is already complete (%d tokens)", out, previous.n_tokens)
        return out
    done_seqs = sum(s["sequences"] for s in previous.shards) if previous else 0
    windows = _traced_windows(model, tokenizer, texts, seq_len, max_tokens, done_seqs, batch_size,
                              decode_tokens, prompt_tokens)
    first = next(windows, None)
    if first is None and done_seqs == 0:
        raise TraceError(f"dataset {dataset!r} split {split!r} gave no tokens to trace")
    writer = TraceWriter(out, previous or manifest)
    if done_seqs:
        log.info("resuming the trace in %s after %d tokens", out, writer.manifest.n_tokens)
    with tqdm(total=max_tokens, initial=writer.manifest.n_tokens, unit="tok", desc=f"trace {dataset}/{split}") as bar:
        try:
            trace_windows(model, layers, chain([first], windows) if first else windows, writer,
                          pad_id=tokenizer.pad_token_id, top_t=manifest.top_t, batch_size=batch_size,
                          shard_sequences=shard_sequences, first_seq=done_seqs, progress=bar)
        except TraceError as exc:  # a routing the trace cannot hold: say which model
            raise TraceError(f"{fingerprint.arch}: {exc}") from exc
    writer.finish()
    log.info("traced %d tokens of %s/%s into %s", writer.manifest.n_tokens, dataset, split, out)
    return out


def _traced_windows(model, tokenizer, texts, seq_len: int, max_tokens: int, done_seqs: int, batch_size: int,
                    decode_tokens: int | None, prompt_tokens: int) -> Iterator[list[int]]:
    """The sequences still to trace after the first `done_seqs`: the corpus's windows, or for a
    decode trace a prompt from each and its greedy continuation (each prompt's sequence counted at
    its longest, so at most `max_tokens` are traced)."""
    if decode_tokens is None:
        return islice(token_windows(tokenizer, texts, seq_len, max_tokens), done_seqs, None)
    wanted = max(max_tokens // (prompt_tokens + decode_tokens), 1)
    windows = token_windows(tokenizer, texts, seq_len, 2**62)
    prompts = islice(prompt_windows(windows, prompt_tokens), done_seqs, wanted)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    # a shard's continuations all come before its forward: a bar of their own, or the trace's would stand still
    progress = tqdm(total=wanted, initial=done_seqs, unit="prompt", desc="greedy continuations", position=1,
                    leave=False)
    return greedy_continuations(model, prompts, decode_tokens, batch_size, eos, pad, progress)
