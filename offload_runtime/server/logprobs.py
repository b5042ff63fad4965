"""Log-probabilities of tokens, as the legacy completions API returns them with `logprobs: N`.

The inference thread computes them (`token_logprob`, `prompt_logprobs`) from the model's raw
logits in float32: the log-softmax the model itself gives, before temperature, top-p or
`min_tokens` shape the sampling. The HTTP side writes them as OpenAI's `logprobs` object
(`completion_logprobs`): per token its text, its logprob, the top N candidates with theirs (the
token itself always among them, so up to N + 1, as OpenAI and vLLM send), and its character
offset in the choice's text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most top candidates a request may ask for (vLLM's default limit)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the top N (token id, logprob), most likely first


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """`token`'s entry from one position's logits ([V])."""
    return _entries(logits[None], [token], top_n)[0]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top_n: int) -> list[TokenLogprob | None]:
    """Each prompt token's entry given the tokens before it: `logits` [len(prompt_ids) - 1, V] are
    the forward's outputs at the prompt's positions but the last. The first token has none."""
    return [None, *_entries(logits, prompt_ids[1:], top_n)]


def _entries(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logprobs.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(token, lp, tuple(zip(i, v, strict=True)))
            for token, lp, i, v in zip(tokens, chosen, ids, values, strict=True)]


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], token_ids: list[int],
                        offset: int = 0) -> dict:
    """OpenAI's `logprobs` object of `token_ids` (their `entries`; None: no logprob, as the first
    prompt token's), text offsets counted from `offset`."""
    tokens = [_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = []
    for entry in entries:
        if entry is None:
            top.append(None)
            continue
        candidates = {_text(tokenizer, t): lp for t, lp in entry.top}
        candidates.setdefault(_text(tokenizer, entry.token_id), entry.logprob)
        top.append(candidates)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
