"""Routing statistics of a MoE model, measured as the field measures them.

Over held-out windows, per MoE layer:
  expert_load            each expert's share of the top-k selections (and the load's entropy)
  top1_repeat            how often a token keeps the previous token's top-1 expert (Mixtral
                         paper, sec. 5); beside it the chance of that with independent tokens
                         drawn from the layer's load (`top1_repeat_chance`)
  router_entropy         mean entropy (nats) of the router's softmax, and as a share of log E
  lookahead_recall       gate lookahead: layer l+1's router on layer l's input, recall@k of
                         layer l+1's experts (HybriMoE, AdapMoE; layer 0 has none)
  token_table_recall     a per-token-id table of selections, fit on other windows (`fit`), recall@k
Summaries average the layers after the first, where lookahead applies.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm

from predictor.lookahead import GateLookahead
from prescient.arch import find_moe_layers
from training.router_hooks import RouterRecorder


def _batches(windows: torch.Tensor, batch_size: int, what: str):
    return tqdm(windows.split(batch_size), desc=f"routing statistics: {what}", unit="batch", leave=False)


@torch.no_grad()
def _token_table(model: nn.Module, recorder: RouterRecorder, windows: torch.Tensor, vocab: int, n_experts: int,
                 batch_size: int) -> torch.Tensor:
    """counts [vocab, L, E]: how often each token id was routed to each expert."""
    counts = torch.zeros(vocab, len(recorder.layers), n_experts)
    for ids in _batches(windows, batch_size, "token table"):
        with recorder.recording():
            model(input_ids=ids)
        _, selected = recorder.stacked(*ids.shape)  # [B, S, L, k]
        tokens = ids[..., None, None].expand_as(selected).reshape(-1)
        layer = torch.arange(selected.shape[2])[None, None, :, None].expand_as(selected).reshape(-1)
        counts.index_put_((tokens, layer, selected.reshape(-1)), torch.ones(tokens.numel()), accumulate=True)
    return counts


def _recall(guess: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Per layer, the mean share of `selected` [N, L, k] among the top-k of `guess` [N, L, E]."""
    top = guess.topk(selected.shape[-1], dim=-1).indices
    return (top[..., :, None] == selected[..., None, :]).any(-2).float().mean(dim=(0, 2))


@torch.no_grad()
def routing_statistics(model: nn.Module, fit_windows: torch.Tensor, eval_windows: torch.Tensor,
                       batch_size: int = 16) -> dict:
    """The statistics above for a decoder-only MoE `model` over `eval_windows` [N, S] of token
    ids; the token table is fit on `fit_windows`."""
    layers = find_moe_layers(model)
    n_layers, n_experts, k = len(layers), layers[0].num_experts, layers[0].top_k
    recorder = RouterRecorder(layers)
    table = _token_table(model, recorder, fit_windows, model.config.vocab_size, n_experts, batch_size)
    unseen = table.sum(dim=0)  # a token the table never saw guesses the layer's most used experts
    lookahead = GateLookahead(model)
    seen: dict[int, torch.Tensor] = {}
    lookahead.attach(seen.__setitem__)
    logits_all, selected_all, guess_all, table_all = [], [], [], []
    try:
        for ids in _batches(eval_windows, batch_size, "held-out windows"):
            with recorder.recording():
                model(input_ids=ids)
            logits, selected = recorder.stacked(*ids.shape)  # [B, S, L, E], [B, S, L, k]
            guess = torch.stack([seen[i].reshape(*ids.shape, -1).float() for i in range(n_layers)], dim=2)
            rows = table[ids]  # [B, S, L, E]
            rows = torch.where(rows.sum(-1, keepdim=True) > 0, rows, unseen.expand_as(rows))
            logits_all.append(logits.float()), selected_all.append(selected), guess_all.append(guess)
            table_all.append(rows)
    finally:
        lookahead.detach(seen.__setitem__)
    logits, selected = torch.cat(logits_all), torch.cat(selected_all)  # [N, S, L, *]
    flat_sel = selected.reshape(-1, n_layers, k)
    load = torch.stack([torch.bincount(flat_sel[:, l].reshape(-1), minlength=n_experts) for l in range(n_layers)])
    share = load.float() / load.sum(dim=1, keepdim=True)
    top1 = logits.argmax(-1)  # [N, S, L]
    repeat = (top1[:, 1:] == top1[:, :-1]).float().mean(dim=(0, 1))
    top1_share = torch.stack([torch.bincount(top1[..., l].reshape(-1), minlength=n_experts) for l in range(n_layers)])
    top1_share = top1_share.float() / top1_share.sum(dim=1, keepdim=True)
    probs = logits.reshape(-1, n_layers, n_experts).softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean(0)
    lookahead_recall = _recall(torch.cat(guess_all).reshape(-1, n_layers, n_experts), flat_sel)
    token_recall = _recall(torch.cat(table_all).reshape(-1, n_layers, n_experts), flat_sel)
    later = slice(1, None) if n_layers > 1 else slice(None)

    def mean(t: torch.Tensor) -> float:
        return float(t[later].mean())

    return {
        "tokens": int(selected.shape[0] * selected.shape[1]),
        "fit_tokens": int(fit_windows.numel()),
        "layers": n_layers, "experts": n_experts, "top_k": k,
        "expert_load": share.tolist(),
        "load_entropy_share": ((-(share * share.clamp_min(1e-12).log()).sum(1)) / math.log(n_experts)).tolist(),
        "top1_repeat": repeat.tolist(),
        "top1_repeat_chance": (top1_share ** 2).sum(1).tolist(),
        "router_entropy": entropy.tolist(),
        "router_entropy_share": (entropy / math.log(n_experts)).tolist(),
        "lookahead_recall": [None] + lookahead_recall[1:].tolist(),
        "token_table_recall": token_recall.tolist(),
        "summary": {
            "lookahead_recall": mean(lookahead_recall) if n_layers > 1 else None,
            "token_table_recall": mean(token_recall),
            "top1_repeat": mean(repeat),
            "top1_repeat_chance": mean((top1_share ** 2).sum(1)),
            "router_entropy_share": mean(entropy / math.log(n_experts)),
        },
    }
