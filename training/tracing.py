"""`prescient trace`: record router traces of an MoE model over a dataset.

Text is tokenized per document and cut into windows of `seq_len` tokens; windows are
batched with right padding, and only real tokens become rows. Every `shard_sequences`
windows make one shard (see `prescient.traces` for the format). A rerun with the same
settings resumes after the last complete shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prescient.arch import is_encoder_decoder
from prescient.errors import TraceError
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer
from prescient.traces import TraceManifest, TraceWriter, read_manifest
from training.corpora import load_corpus
from training.router_hooks import RouterRecorder

log = logging.getLogger(__name__)


def token_windows(tokenizer, texts, seq_len: int, max_tokens: int) -> Iterator[list[int]]:
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


def pad_batch(windows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(w) for w in windows)
    ids = torch.full((len(windows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(windows), width), dtype=torch.long)
    for row, window in enumerate(windows):
        ids[row, : len(window)] = torch.tensor(window)
        mask[row, : len(window)] = 1
    return ids, mask


def model_inputs(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Forward kwargs; an encoder-decoder also gets the same text, shifted, as decoder input."""
    inputs = {"input_ids": ids, "attention_mask": mask}
    if is_encoder_decoder(model):
        inputs["decoder_input_ids"] = model._shift_right(ids)
        inputs["decoder_attention_mask"] = mask
    return inputs


def rows_of_batch(ids, mask, logits, selected, first_seq: int, top_t: int) -> dict[str, torch.Tensor]:
    """Trace columns for the real (unpadded) tokens of one batch."""
    real = mask.bool()
    seq_ids = (torch.arange(ids.shape[0]) + first_seq).unsqueeze(1).expand_as(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    logits = logits[real]  # [N, L, E]
    top_logits, top_ids = logits.topk(top_t, dim=-1)
    chosen = selected[real]  # [N, L, k]: order best first by the router's logit
    order = logits.gather(-1, chosen).argsort(dim=-1, descending=True)
    return {
        "seq_id": seq_ids[real].to(torch.int64),
        "position": positions[real].to(torch.int32),
        "token_id": ids[real].to(torch.int64),
        "topk_ids": chosen.gather(-1, order).to(torch.int16),
        "topt_ids": top_ids.to(torch.int16),
        "topt_logits": top_logits.to(torch.float32),
    }


def _resume_point(out: Path, manifest: TraceManifest) -> TraceManifest | None:
    """The existing manifest to continue, or None to start over."""
    old = read_manifest(out)
    if old is None:
        return None
    same = (old.fingerprint, old.dataset, old.split, old.top_t, old.settings) == (
        manifest.fingerprint, manifest.dataset, manifest.split, manifest.top_t, manifest.settings)
    if not same:
        raise TraceError(f"{out} already holds a trace made with other settings; choose another --out or delete it")
    for shard in old.shards:
        if not (out / shard["file"]).exists():
            raise TraceError(f"{out} lists shard {shard['file']} that is missing; delete {out} and trace again")
    return old


@torch.no_grad()
def trace_model(model_dir: str | Path, dataset: str, out: str | Path, split: str = "validation",
                max_tokens: int = 50_000, top_t: int = 30, text_field: str = "text", seq_len: int = 128,
                batch_size: int = 16, shard_sequences: int = 256) -> Path:
    """Trace `model_dir` over `dataset`'s split into `out`; resumes an interrupted run."""
    out = Path(out)
    model, layers = load_model(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    fingerprint = fingerprint_model(model, layers)
    texts = load_corpus(dataset, split, text_field)["text"]
    top_t = min(top_t, fingerprint.n_experts)
    manifest = TraceManifest(
        fingerprint=fingerprint, dataset=dataset, split=split, top_t=top_t,
        settings={"max_tokens": max_tokens, "seq_len": seq_len, "shard_sequences": shard_sequences,
                  "text_field": text_field},
    )
    previous = _resume_point(out, manifest)
    if previous is not None and previous.complete:
        log.info("trace in %s is already complete (%d tokens)", out, previous.n_tokens)
        return out
    writer = TraceWriter(out, previous or manifest)
    done_seqs = sum(s["sequences"] for s in writer.manifest.shards)
    windows = token_windows(tokenizer, texts, seq_len, max_tokens)
    windows = islice(windows, done_seqs, None)
    recorder = RouterRecorder(layers)
    bar = tqdm(total=max_tokens, initial=writer.manifest.n_tokens, unit="tok", desc=f"trace {dataset}/{split}")
    seq = done_seqs
    with recorder.recording():
        while chunk := list(islice(windows, shard_sequences)):
            parts: list[dict[str, torch.Tensor]] = []
            for start in range(0, len(chunk), batch_size):
                batch = chunk[start : start + batch_size]
                ids, mask = pad_batch(batch, tokenizer.pad_token_id)
                model(**model_inputs(model, ids, mask))
                logits, selected = recorder.stacked(*ids.shape)
                parts.append(rows_of_batch(ids, mask, logits, selected, seq + start, top_t))
                bar.update(int(mask.sum()))
            columns = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            writer.add_shard(columns, sequences=len(chunk))
            seq += len(chunk)
    bar.close()
    if not writer.manifest.shards:
        raise TraceError(f"dataset {dataset!r} split {split!r} gave no tokens to trace")
    writer.finish()
    log.info("traced %d tokens of %s/%s into %s", writer.manifest.n_tokens, dataset, split, out)
    return out
