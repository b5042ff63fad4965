"""How much of token t+1's experts the model's own next-token guess can find: the ceiling of
forecasting from the LM head (issue 24), measured before building a forecaster on it.

    python -m experiments.next_token_ceiling --model DIR --train-trace DIR --json OUT.json \
        [--forecaster ARTIFACT] [--dataset stdlib-code] [--windows 32] [--seq-len 256]

Teacher-forced on held-out windows; at each position t, with p the model's next-token
distribution and m in (1, 2, 4, 8):
- `next_in_top_m`: how often the true token t+1 is among the m most likely (a current-token hash
  that were perfect would find all of t+1's experts there, and nothing sure elsewhere);
- `lm_top_m_table_recall_at_k` / `_at_2k`: recall of t+1's experts (per layer, averaged) by the
  score sum_c p(c) * table(c) over the top-m tokens c, where table(c) is the token table's expert
  distribution for token id c, fit on the train trace (context-free);
- `true_next_table_recall_*`: the same table on the true token t+1 (a perfect LM through the table);
- with `forecaster` (a predictor with forecast heads, e.g. SiDA-h8): `forecaster_recall_*`, its own
  t+1 forecast on the same positions, and `blend`: its chances of use mixed with the LM's top-8
  through the table (k times its expert distribution) at weights w of the forecaster.

JSON: {model, train_trace, dataset, split, windows, seq_len, positions, true_next_table_recall_at_k,
true_next_table_recall_at_2k, top_m: {m: {next_in_top_m, lm_top_m_table_recall_at_k,
lm_top_m_table_recall_at_2k}}, [forecaster, forecaster_recall_at_k, forecaster_recall_at_2k,
blend: {w: {recall_at_k, recall_at_2k}}]}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from predictor.artifact import load_predictor
from predictor.baselines import TokenTablePredictor
from prescient.atomic import write_json_atomic
from prescient.loading import load_model, load_tokenizer
from prescient.traces import load_trace
from training.reference_lm import corpus_windows
from training.router_hooks import RouterRecorder

TOP_M = (1, 2, 4, 8)
BLEND_WEIGHTS = (0.25, 0.5, 0.75)


def _recall(scores: torch.Tensor, true: torch.Tensor, n: int) -> float:
    """Mean over positions and layers of the share of `true` [P, L, k] among the top-n of `scores` [P, L, E]."""
    top = scores.topk(n, dim=-1).indices
    return (true.unsqueeze(-1) == top.unsqueeze(-2)).any(-1).float().mean().item()


@torch.no_grad()
def measure(model_dir: str | Path, train_trace: str | Path, dataset: str = "stdlib-code", windows: int = 32,
            seq_len: int = 256, batch_size: int = 8, split: str = "validation",
            forecaster: str | Path | None = None) -> dict:
    model, layers = load_model(model_dir, dtype=torch.float32)
    table = TokenTablePredictor.from_trace(load_trace(train_trace)).token_counts.float()  # [V, L, E]
    table = table / table.sum(-1, keepdim=True).clamp_min(1)
    held_out = corpus_windows(load_tokenizer(model_dir), dataset, split, "text", seq_len, windows)
    k = layers[0].top_k
    predictor = None if forecaster is None else load_predictor(forecaster)
    probs, true_next, tokens, forecasts = [], [], [], []
    recorder = RouterRecorder(layers)
    with recorder.recording():
        for batch in held_out.split(batch_size):
            logits = model(batch).logits[:, :-1].float()
            _, selected = recorder.stacked(*batch.shape)  # [B, S, L, k]
            probs.append(torch.softmax(logits, -1).reshape(-1, logits.shape[-1]))
            true_next.append(selected[:, 1:].reshape(-1, *selected.shape[2:]))
            tokens.append(batch[:, 1:].reshape(-1))
            if predictor is not None:  # token t's forecast of t+1, as chances of use
                scores = predictor.predict_with_forecasts(batch, horizon=1)[1][:, :-1, 0]
                forecasts.append(predictor.chance_selected(scores, k).reshape(-1, *scores.shape[2:]))
    probs, true_next, tokens = torch.cat(probs), torch.cat(true_next), torch.cat(tokens)
    result = {"model": str(model_dir), "train_trace": str(train_trace), "dataset": dataset, "split": split,
              "windows": len(held_out),
              "seq_len": seq_len, "positions": len(tokens),
              "true_next_table_recall_at_k": _recall(table[tokens], true_next, k),
              "true_next_table_recall_at_2k": _recall(table[tokens], true_next, 2 * k), "top_m": {}}
    for m in TOP_M:
        p, candidates = probs.topk(m, dim=-1)  # [P, m]
        scores = torch.einsum("pm,pmle->ple", p, table[candidates])
        result["top_m"][m] = {"next_in_top_m": (candidates == tokens.unsqueeze(1)).any(1).float().mean().item(),
                              "lm_top_m_table_recall_at_k": _recall(scores, true_next, k),
                              "lm_top_m_table_recall_at_2k": _recall(scores, true_next, 2 * k)}
    if predictor is not None:
        chances, lm = torch.cat(forecasts).float(), k * scores  # `scores`: the LM's top-8 mixture
        result.update(forecaster=str(forecaster), forecaster_recall_at_k=_recall(chances, true_next, k),
                      forecaster_recall_at_2k=_recall(chances, true_next, 2 * k), blend={
                          w: {"recall_at_k": _recall(w * chances + (1 - w) * lm, true_next, k),
                              "recall_at_2k": _recall(w * chances + (1 - w) * lm, true_next, 2 * k)}
                          for w in BLEND_WEIGHTS})
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
    args = parser.parse_args()
    write_json_atomic(args.json, measure(args.model, args.train_trace, args.dataset, args.windows, args.seq_len,
                                         forecaster=args.forecaster))


if __name__ == "__main__":
    main()
