"""How much of token t+1's experts the model's own state can find: the ceiling of forecasting
from the LM head and the hidden states (issue 24), measured before building a forecaster on them.

    python -m experiments.next_token_ceiling --model DIR --train-trace DIR --json OUT.json \
        [--forecaster ARTIFACT] [--dataset stdlib-code] [--windows 32] [--seq-len 256] \
        [--in-context] [--probe-windows 400]

Teacher-forced on held-out windows; at each position t, with p the model's next-token
distribution and m in (1, 2, 4, 8):
- `next_in_top_m`: how often the true token t+1 is among the m most likely (a current-token hash
  that were perfect would find all of t+1's experts there, and nothing sure elsewhere);
- `lm_top_m_table_recall_at_k` / `_at_2k`: recall of t+1's experts (per layer, averaged) by the
  score sum_c p(c) * table(c) over the top-m tokens c, where table(c) is the token table's expert
  distribution for token id c, fit on the train trace (context-free);
- `true_next_table_recall_*`: the same table on the true token t+1 (a perfect LM through the table);
- with `in_context`: `lm_top_m_in_context_recall_*`, the score sum_c p(c) * picks(c) where picks(c)
  are the experts the model's own routers pick for c at position t+1 after the true tokens <= t (the
  oracle hash: a perfect current-token predictor applied to each of the LM's guesses);
- with `probe_windows`: `state_probes`, a small network fit (Lightning, on that many train-split
  windows) from one of the model's states to t+1's experts, for each point in token t's decode step
  where a forecaster could read it: `step_start` (the final hidden state of token t-1 and token t's
  embedding: what exists when token t's forward begins), `mid_forward` (the input of the middle
  decoder layer at token t) and `forward_end` (token t's final hidden state: when t+1 is sampled
  anyway). Probe positions leave out each window's first token (it has no token t-1);
- with `forecaster` (a predictor with forecast heads, e.g. SiDA-h8): `forecaster_recall_*`, its own
  t+1 forecast on the same positions, and `blend`: its chances of use mixed with the LM's top-8
  through the table (k times its expert distribution) at weights w of the forecaster.

JSON: {model, train_trace, dataset, split, windows, seq_len, positions, true_next_table_recall_at_k,
true_next_table_recall_at_2k, top_m: {m: {next_in_top_m, lm_top_m_table_recall_at_k,
lm_top_m_table_recall_at_2k, [lm_top_m_in_context_recall_at_k, lm_top_m_in_context_recall_at_2k,
[in_context_blend_recall_at_2k]]}}, [forecaster, forecaster_recall_at_k, forecaster_recall_at_2k,
blend: {w: {recall_at_k, recall_at_2k}}], [state_probes: {probe_windows, positions,
[forecaster_recall_at_2k], inputs: {name: {recall_at_k, recall_at_2k, [blend_recall_at_2k]}}}]}.
Blends with the forecaster weigh its chances of use and the other score half and half.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from transformers import PreTrainedModel

from predictor.artifact import load_predictor
from predictor.baselines import TokenTablePredictor
from predictor.forecast import chance_selected
from prescient.atomic import write_json_atomic
from prescient.loading import load_model, load_tokenizer
from prescient.traces import load_trace
from training.reference_lm import corpus_windows
from training.router_hooks import RouterRecorder

TOP_M = (1, 2, 4, 8)
BLEND_WEIGHTS = (0.25, 0.5, 0.75)
PROBE_INPUTS = ("step_start", "mid_forward", "forward_end")
PROBE_EPOCHS = 10


def _recall(scores: torch.Tensor, true: torch.Tensor, n: int) -> float:
    """Mean over positions and layers of the share of `true` [P, L, k] among the top-n of `scores` [P, L, E]."""
    top = scores.topk(n, dim=-1).indices
    return (true.unsqueeze(-1) == top.unsqueeze(-2)).any(-1).float().mean().item()


def _picked(selected: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[..., L, k] expert ids as [..., L, E] 0/1."""
    return torch.zeros(*selected.shape[:-1], n_experts).scatter_(-1, selected.long(), 1.0)


@torch.no_grad()
def in_context_picks(model: PreTrainedModel, recorder: RouterRecorder, window: torch.Tensor,
                     candidates: torch.Tensor) -> torch.Tensor:
    """[S-1, m, L, k]: for each position t of `window` [S] and each of its candidates [S-1, m] for
    token t+1, the experts every MoE layer's router picks for the candidate after the true tokens
    <= t (one forward of the m candidates on the window's KV cache cut back to t+1 tokens)."""
    cache = model(window[None], use_cache=True).past_key_values
    recorder.stacked(1, len(window))  # this forward's own routing is not what is asked
    picks = []
    for t, row in enumerate(candidates):
        prefix = copy.deepcopy(cache)
        prefix.crop(t + 1 - len(window))  # drop all but the first t+1 tokens
        prefix.batch_repeat_interleave(len(row))
        model(row[:, None], past_key_values=prefix, use_cache=True)
        picks.append(recorder.stacked(len(row), 1)[1][:, 0])
    return torch.stack(picks)


class _StateProbe(L.LightningModule):
    """A small network from one model state to each MoE layer's expert scores for token t+1."""

    def __init__(self, width: int, layers: int, experts: int):
        super().__init__()
        self.layers, self.experts = layers, experts
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 512), torch.nn.GELU(),
                                       torch.nn.Linear(512, layers * experts))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.net(state).view(-1, self.layers, self.experts)

    def training_step(self, batch, _index):
        state, picked = batch  # picked: [B, L, E] 0/1, k ones per layer
        return -(F.log_softmax(self(state), -1) * picked).sum(-1).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01)


def _probe_states(model: PreTrainedModel, recorder: RouterRecorder, windows: torch.Tensor,
                  batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per probe input, the states [P, width] at positions 1..S-2 of every window, and the experts
    [P, L, k] token t+1 routed to."""
    embed = model.get_input_embeddings()
    states: dict[str, list] = {name: [] for name in PROBE_INPUTS}
    targets = []
    for batch in windows.split(batch_size):
        hidden = model(batch, output_hidden_states=True).hidden_states  # embeddings, then each layer's output
        _, selected = recorder.stacked(*batch.shape)
        final = hidden[-1]
        for name, state in (("step_start", torch.cat([final[:, :-2], embed(batch[:, 1:-1])], -1)),
                            ("mid_forward", hidden[len(hidden) // 2][:, 1:-1]), ("forward_end", final[:, 1:-1])):
            states[name].append(state.reshape(-1, state.shape[-1]).float())
        targets.append(selected[:, 2:].reshape(-1, *selected.shape[2:]))
    return {name: torch.cat(parts) for name, parts in states.items()}, torch.cat(targets)


@torch.no_grad()
def _fit_probe(train_state: torch.Tensor, train_picked: torch.Tensor, seed: int = 0) -> tuple[_StateProbe, tuple]:
    """A probe fit on standardised states; returns it with the (mean, std) to apply to others."""
    mean, std = train_state.mean(0), train_state.std(0) + 1e-5
    L.seed_everything(seed, verbose=False)
    probe = _StateProbe(train_state.shape[1], *train_picked.shape[1:])
    data = DataLoader(TensorDataset((train_state - mean) / std, train_picked), batch_size=512, shuffle=True)
    with torch.enable_grad():
        L.Trainer(max_epochs=PROBE_EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu").fit(probe, data)
    return probe.eval(), (mean, std)


@torch.no_grad()
def state_probes(model: PreTrainedModel, recorder: RouterRecorder, train: torch.Tensor, held_out: torch.Tensor,
                 top_k: int, batch_size: int = 8, forecasts: torch.Tensor | None = None) -> dict:
    """Recall of t+1's experts by a probe per model state (see the module doc); `forecasts`
    [windows, S, L, E]: a forecaster's chances for t+1 at every position, blended in."""
    train_states, train_true = _probe_states(model, recorder, train, batch_size)
    states, true = _probe_states(model, recorder, held_out, batch_size)
    n_experts = recorder.layers[0].num_experts
    result: dict = {"probe_windows": len(train), "positions": len(true), "inputs": {}}
    chances = None if forecasts is None else forecasts[:, 1:-1].reshape(-1, *forecasts.shape[2:])
    if chances is not None:
        result["forecaster_recall_at_2k"] = _recall(chances, true, 2 * top_k)
    for name in PROBE_INPUTS:
        probe, (mean, std) = _fit_probe(train_states[name], _picked(train_true, n_experts))
        scores = probe((states[name] - mean) / std)
        row = {"recall_at_k": _recall(scores, true, top_k), "recall_at_2k": _recall(scores, true, 2 * top_k)}
        if chances is not None:
            row["blend_recall_at_2k"] = _recall(0.5 * chances + 0.5 * chance_selected(scores, top_k), true,
                                                2 * top_k)
        result["inputs"][name] = row
    return result


@torch.no_grad()
def measure(model_dir: str | Path, train_trace: str | Path, dataset: str = "stdlib-code", windows: int = 32,
            seq_len: int = 256, batch_size: int = 8, split: str = "validation",
            forecaster: str | Path | None = None, in_context: bool = False, probe_windows: int = 0) -> dict:
    model, layers = load_model(model_dir, dtype=torch.float32)
    table = TokenTablePredictor.from_trace(load_trace(train_trace)).token_counts.float()  # [V, L, E]
    table = table / table.sum(-1, keepdim=True).clamp_min(1)
    tokenizer = load_tokenizer(model_dir)
    held_out = corpus_windows(tokenizer, dataset, split, "text", seq_len, windows)
    k, n_experts = layers[0].top_k, layers[0].num_experts
    predictor = None if forecaster is None else load_predictor(forecaster)
    probs, true_next, tokens, forecasts, picks = [], [], [], [], []
    recorder = RouterRecorder(layers)
    with recorder.recording():
        for batch in held_out.split(batch_size):
            logits = model(batch).logits[:, :-1].float()
            _, selected = recorder.stacked(*batch.shape)  # [B, S, L, k]
            batch_probs = torch.softmax(logits, -1)
            probs.append(batch_probs.reshape(-1, logits.shape[-1]))
            true_next.append(selected[:, 1:].reshape(-1, *selected.shape[2:]))
            tokens.append(batch[:, 1:].reshape(-1))
            if predictor is not None:  # token t's forecast of t+1, as chances of use
                scores = predictor.predict_with_forecasts(batch, horizon=1)[1][:, :, 0]
                forecasts.append(predictor.chance_selected(scores, k))  # [B, S, L, E]
            if in_context:
                picks += [in_context_picks(model, recorder, window, row.topk(max(TOP_M), -1).indices)
                          for window, row in zip(batch, batch_probs)]
        probe_result = None
        if probe_windows:
            train = corpus_windows(tokenizer, dataset, "train", "text", seq_len, probe_windows)
            probe_result = state_probes(model, recorder, train, held_out, k, batch_size,
                                        torch.cat(forecasts).float() if forecasts else None)
    probs, true_next, tokens = torch.cat(probs), torch.cat(true_next), torch.cat(tokens)
    chances = torch.cat(forecasts)[:, :-1].reshape(-1, *true_next.shape[1:-1], n_experts).float() \
        if forecasts else None
    in_context_scores = _picked(torch.cat(picks), n_experts) if in_context else None  # [P, m, L, E]
    result = {"model": str(model_dir), "train_trace": str(train_trace), "dataset": dataset, "split": split,
              "windows": len(held_out),
              "seq_len": seq_len, "positions": len(tokens),
              "true_next_table_recall_at_k": _recall(table[tokens], true_next, k),
              "true_next_table_recall_at_2k": _recall(table[tokens], true_next, 2 * k), "top_m": {}}
    for m in TOP_M:
        p, candidates = probs.topk(m, dim=-1)  # [P, m]
        scores = torch.einsum("pm,pmle->ple", p, table[candidates])
        row = {"next_in_top_m": (candidates == tokens.unsqueeze(1)).any(1).float().mean().item(),
               "lm_top_m_table_recall_at_k": _recall(scores, true_next, k),
               "lm_top_m_table_recall_at_2k": _recall(scores, true_next, 2 * k)}
        if in_context:
            oracle = torch.einsum("pm,pmle->ple", p, in_context_scores[:, :m])
            row.update(lm_top_m_in_context_recall_at_k=_recall(oracle, true_next, k),
                       lm_top_m_in_context_recall_at_2k=_recall(oracle, true_next, 2 * k))
            if chances is not None:
                row["in_context_blend_recall_at_2k"] = _recall(0.5 * chances + 0.5 * oracle, true_next, 2 * k)
        result["top_m"][m] = row
    if chances is not None:
        lm = k * scores  # `scores`: the LM's top-8 mixture through the table
        result.update(forecaster=str(forecaster), forecaster_recall_at_k=_recall(chances, true_next, k),
                      forecaster_recall_at_2k=_recall(chances, true_next, 2 * k), blend={
                          w: {"recall_at_k": _recall(w * chances + (1 - w) * lm, true_next, k),
                              "recall_at_2k": _recall(w * chances + (1 - w) * lm, true_next, 2 * k)}
                          for w in BLEND_WEIGHTS})
    if probe_result is not None:
        result["state_probes"] = probe_result
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-trace", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--forecaster", default=None, help="a predictor artifact with forecast heads to blend in")
    parser.add_argument("--dataset", default="stdlib-code")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--in-context", action="store_true",
                        help="also map the LM's top-m guesses through the model's own routers in context")
    parser.add_argument("--probe-windows", type=int, default=0,
                        help="fit state probes on this many train-split windows (0: none)")
    args = parser.parse_args()
    write_json_atomic(args.json, measure(args.model, args.train_trace, args.dataset, args.windows, args.seq_len,
                                         forecaster=args.forecaster, in_context=args.in_context,
                                         probe_windows=args.probe_windows))


if __name__ == "__main__":
    main()
