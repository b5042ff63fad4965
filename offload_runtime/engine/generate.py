"""Generation through the offloading runtime, greedy or seeded sampling, with its statistics and
timings: what `prescient generate` prints and the demo records."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from offload_runtime.engine.memory_guard import major_faults
from offload_runtime.engine.memory_plan import Reserves, model_context
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import LoadRequest
from prescient.errors import PrescientError
from prescient.proc_io import storage_reads
from prescient.model_dir import ModelDirectory


class TokenClock:
    """A generate() streamer that only notes when each put arrives (the prompt, then each token),
    how many major page faults the process had taken by then and how many bytes it had read from
    storage: under a memory cap, pages the kernel took back (the libraries' code, a mapped
    checkpoint) are read again from disk, a cost that no runtime statistic shows, and one the
    memory-mapped model also pays in read-ahead beyond what it uses."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.faults: list[int] = []
        self.reads: list[int | None] = []

    def put(self, _value: Any) -> None:
        self.times.append(time.perf_counter())
        self.faults.append(major_faults())
        self.reads.append(storage_reads())

    def end(self) -> None:
        self.put(None)

    def decode_faults_per_token(self, new_tokens: int) -> float | None:
        """Major page faults per token from the first new token to the last (None for one token)."""
        return (self.faults[new_tokens] - self.faults[1]) / (new_tokens - 1) if new_tokens > 1 else None

    def decode_read_bytes_per_token(self, new_tokens: int) -> float | None:
        """Bytes read from storage per token from the first new token to the last (None for one
        token, or where the system does not count them)."""
        if new_tokens < 2 or self.reads[1] is None:
            return None
        return (self.reads[new_tokens] - self.reads[1]) / (new_tokens - 1)


class GenerationError(PrescientError):
    """A generation request the model cannot serve: an empty prompt, one beyond its context, or
    sampling settings out of range."""


@dataclass(frozen=True)
class Sampling:
    """Seeded sampling: torch's `seed`, then nucleus sampling at `temperature` (> 0) from the
    smallest set of tokens holding `top_p` (in (0, 1]) of the probability. The same seed through
    the runtime draws the same tokens as the plain model, since offloading computes the same logits."""

    seed: int
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise GenerationError(f"temperature {self.temperature} is not a positive number; give e.g. 0.7")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p {self.top_p} is not in (0, 1]; give e.g. 0.9")


def check_prompt(prompt_tokens: int, max_new_tokens: int, model_dir: str | Path | ModelDirectory) -> None:
    """At least one prompt token and one new token, and both within the model's context."""
    if prompt_tokens == 0:
        raise GenerationError("the prompt is empty (0 tokens); give --prompt some text")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens is {max_new_tokens}; ask for at least 1 new token")
    context = model_context(ModelDirectory.of(model_dir).config)  # None: relative positions, no bound
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise GenerationError(f"the prompt is {prompt_tokens} tokens and {max_new_tokens} new ones are asked for, "
                              f"beyond the model's context of {context} tokens; shorten the prompt or lower "
                              "--max-new-tokens")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: what to load (`load`, a `LoadRequest`), the `prompt`, how many new tokens,
    greedy or with `sampling`. `prescient generate` builds it from its flags, `generate_offloaded`
    from its arguments; `generate` runs it."""

    load: LoadRequest
    prompt: str
    max_new_tokens: int = 32
    sampling: Sampling | None = None


def generate_offloaded(model_dir: str | Path | ModelDirectory, prompt: str, max_new_tokens: int = 32, *,
                       predictor: str | Path | None = None, options: RuntimeOptions | None = None,
                       sampling: Sampling | None = None, **settings: Any) -> dict[str, Any]:
    """Generate with the experts offloaded (`load_offloaded`'s options, whole or as keywords),
    greedily or with `sampling`; the record holds the settings (every option, the decoding), the
    new token ids and text, the runtime's statistics, prefill seconds and decode tokens/s."""
    request = GenerateRequest(LoadRequest(model_dir, predictor, options, settings), prompt, max_new_tokens, sampling)
    return generate(request)


def generate(request: GenerateRequest) -> dict[str, Any]:
    """`generate_offloaded` of a `GenerateRequest`: its options resolved once, the prompt checked,
    the model loaded with KV reserved for this request, then timed generation."""
    from offload_runtime.engine.loader import load

    asked = request.load.resolved()
    options, directory = asked.options, ModelDirectory.of(asked.model_dir)
    tokenizer = directory.tokenizer()
    inputs = tokenizer(request.prompt, return_tensors="pt")
    check_prompt(inputs["input_ids"].shape[1], request.max_new_tokens, directory)
    reserves = Reserves(context_tokens=inputs["input_ids"].shape[1] + request.max_new_tokens)  # not 4096 tokens
    with load(replace(asked, model_dir=directory, reserves=reserves)) as loaded:
        timed = timed_generate(loaded, tokenizer, inputs.to(options.device), request.max_new_tokens, request.sampling)
        stats = loaded.runtime.stats()
    # the tokens a memory cap's plan reserved KV for: the options' own, else this request's
    reserved = options.context_tokens or (reserves.context_tokens if options.memory is not None else None)
    return {
        "settings": {"model": str(asked.model_dir), "predictor": asked.predictor and str(asked.predictor),
                     "max_new_tokens": request.max_new_tokens, **options.to_json(), "context_tokens": reserved,
                     "decoding": "greedy" if request.sampling is None else {"sampled": asdict(request.sampling)}},
        "prompt": request.prompt,
        **timed,
        "text": tokenizer.decode(timed["token_ids"], skip_special_tokens=True),
        "stats": stats.to_dict(),
        "memory_plan": loaded.plan.to_json() if loaded.plan is not None else None,
    }


def timed_generate(model, tokenizer, inputs, max_new_tokens: int, sampling: Sampling | None = None) -> dict[str, Any]:
    """`model.generate` on tokenized `inputs` (batch 1), greedy or with `sampling`, timed by a
    streamer: the new token ids, prefill seconds (to the first new token), decode tokens/s (from
    the first new token to the last), and major page faults and bytes read from storage per
    decoded token."""
    import torch

    clock = TokenClock()
    decoding: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        torch.manual_seed(sampling.seed)
        decoding = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=clock,
                             pad_token_id=tokenizer.pad_token_id, **decoding)
    # a decoder's output repeats the prompt; an encoder-decoder's starts with the decoder start token
    first = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    token_ids = out[0, first:].tolist()
    # clock: prompt put (before prefill), one put per new token, end
    decode_s = clock.times[len(token_ids)] - clock.times[1] if len(token_ids) > 1 else None
    return {"token_ids": token_ids,
            "prefill_seconds": clock.times[1] - clock.times[0] if token_ids else None,
            "tokens_per_s": (len(token_ids) - 1) / decode_s if decode_s else None,
            "decode_major_faults_per_token": clock.decode_faults_per_token(len(token_ids)),
            "decode_read_bytes_per_token": clock.decode_read_bytes_per_token(len(token_ids))}
