"""The results page `predictors`: how well each predictor guesses the current and the next tokens' experts."""

from __future__ import annotations

from experiments.report_pages.rows import evaluate_rows, forecast_rows
from experiments.report_tables import Headline, Page, Rows, Table, load, num, pct


def probe_rows() -> Rows:
    """recall@k per layer, a layers ahead, of the hidden-state probe and gate lookahead."""
    predictors = load("evaluate-probe-short.json")["predictors"]
    rows = []
    for name, label in (("probe", "trained probe"), ("lookahead", "gate lookahead")):
        for a, r in predictors[name]["ahead"].items():
            per_layer = r["per_layer"]["recall_at_k"]
            rows.append([label, a, *(num(v, 3) for v in per_layer), num(r["recall_at_k"], 3)])
    n = len(per_layer)
    return ["predictor", "layers ahead", *(f"layer {i}" for i in range(n)), "mean"], rows


def ablation_rows() -> Rows:
    """The SiDA loss ablation: recall per loss variant, and the baselines."""
    d = load("sida-ablation-base.json")
    rows = [[v, num(r["best"]["val/recall_at_k"], 3), num(r["best"]["val/recall_at_2k"], 3), num(r["seconds"], 1)]
            for v, r in d["variants"].items()]
    rows += [[f"{b} (baseline)", num(r["recall_at_k"], 3), num(r["recall_at_2k"], 3), "–"]
             for b, r in d["baselines"].items()]
    return ["loss variant", "recall@k", "recall@2k", "seconds"], rows


def cross_dataset_rows() -> Rows:
    """recall@k of SiDA and the token table trained on one corpus, evaluated on each."""
    c = load("cross-dataset.json")["cross_dataset"]
    rows = []
    for kind in ("predictor", "token"):
        for trained in c["train_datasets"]:
            rows.append([f"{'SiDA' if kind == 'predictor' else 'token table'}, trained on {trained}",
                         *(num(c[kind]["recall_at_k"][trained][ev], 3) for ev in c["datasets"])])
    return ["recall@k: trained on ↓ / evaluated on →", *c["datasets"]], rows


def ceiling_rows() -> Rows:
    """What a forecast of token t+1 can read, when it exists, and the recall it reaches."""
    d = load("next-token-ceiling-base.json")
    p = d["state_probes"]["inputs"]
    rows = [["the forecaster's head (token ids up to t)", "before token t's forward", num(d["forecaster_recall_at_2k"], 3), "–"]]
    for key, label, when in (("step_start", "probe on token t−1's final state and token t's embedding", "before token t's forward"),
                             ("mid_forward", "probe on the middle layer's input at token t", "halfway through token t's forward"),
                             ("forward_end", "probe on token t's final hidden state", "after token t's forward")):
        rows.append([label, when, num(p[key]["recall_at_2k"], 3), num(p[key]["blend_recall_at_2k"], 3)])
    for m, r in d["top_m"].items():
        rows.append([f"the LM's top-{m} guesses through the model's routers in context (true token in top-{m}: "
                     f"{pct(r['next_in_top_m'], 1, signed=False)})", "after token t's forward",
                     num(r["lm_top_m_in_context_recall_at_2k"], 3), num(r["in_context_blend_recall_at_2k"], 3)])
    return ["what the forecast of token t+1 reads", "when it exists", "t+1 recall@2k", "blended with the forecaster"], rows


def cost_rows() -> Rows:
    """What the SiDA hash function and tracing cost."""
    lat, tr = load("sida-latency-reference-base.json"), load("bench-tracing-reference-base.json")
    return ["measure", "value"], [
        ["SiDA hash function, one decode step for all layers: median / p99 ms", f"{num(lat['ms_per_token_median'], 3)} / {num(lat['ms_per_token_p99'], 3)}"],
        ["its CPU ms per step", num(lat["cpu_ms_per_token"], 3)],
        ["plain forward tokens/s / traced tokens/s", f"{num(tr['plain_tokens_per_s'], 0)} / {num(tr['traced_tokens_per_s'], 0)}"],
        ["tracing overhead", pct(tr["overhead_pct"] / 100, 2)],
    ]


def artifact_rows() -> Rows:
    """The SiDA artifact: what it was trained on and its validation recall."""
    m = load("sida-predictor-base.json")
    t = m["training"]["config"]
    return ["predictor artifact", "kind", "trained on", "max time", "horizon", "validation recall@k / @2k"], [[
        f"`{t['export']}`", m["kind"], f"{m['training']['n_tokens']} tokens of {m['training']['dataset']}",
        t["trainer"]["max_time"], t["model"]["horizon"],
        f"{num(m['metrics']['val/recall_at_k'], 3)} / {num(m['metrics']['val/recall_at_2k'], 3)}"]]


def page() -> Page:
    return Page("predictors", "Predictors and forecasts", """
On the base model SiDA's hash function guesses the current token's experts best of every predictor
that does not read the trace, ahead of gate lookahead and a per-token table, and does so on the
corpus it was not trained on too; its own loss (SiDA's) is as good as any variant tried. Forecasting
the *next* tokens' experts is much harder: the forecast heads beat every training-free forecaster,
but no forecast available in time reaches the 0.80 recall that would make learned eviction close
the gap to Belady. The hash function costs a fraction of a millisecond per token and tracing costs
nothing measurable, so prediction is cheap; its accuracy is the limit. Inside a token, a small
probe trained on each layer's hidden state guesses the next layers' experts far better than the
next layers' own routers do, on a barely trained stand-in; it is not yet measured on the base model.
""", (
        Table("Predictors on the base model", ("evaluate-base.json",),
              "prescient evaluate --trace runs/base-traces/validation --train-trace runs/base-traces/train --model "
              "runs/reference-bench-base --predictors sida=runs/base-predictor/sida,corr,token,freq,lookahead,oracle",
              lambda: evaluate_rows("evaluate-base.json")),
        Table("The SiDA artifact evaluated above", ("sida-predictor-base.json",),
              "prescient train --config configs/predictor/sida.yaml --data.trace_dir runs/base-traces/train "
              "--trainer.max_time 00:00:08:00 --export runs/base-predictor/sida", artifact_rows),
        Table("Loss ablation (300 steps each, held-out tenth of the training trace)", ("sida-ablation-base.json",),
              "prescient ablation runs/base-traces/train OUT.json --model runs/reference-bench-base --max-steps 300 "
              "--variants paper,kl,ce1,bce0.1,topk_ce0.1,topk_ce_only", ablation_rows),
        Table("Across corpora", ("cross-dataset.json",),
              "prescient evaluate --model runs/reference-bench-base --trace runs/base-traces/validation --predictors "
              "token --cross code=...,docs=...", cross_dataset_rows,
              note="Each SiDA trained with configs/predictor/sida.yaml for at most 8 minutes on 300 000 tokens of its corpus."),
        Table("Forecasts of the next tokens' experts", ("evaluate-forecast-base.json",),
              "prescient evaluate --trace runs/base-traces/validation --train-trace runs/base-traces/train "
              "--predictors sida=runs/base-predictor/sida,sida-h8=runs/forecast-base/sida-h8,token,freq",
              lambda: forecast_rows("evaluate-forecast-base.json", "sida-h8"),
              note="sida-h8 is configs/predictor/sida.yaml trained with `--model.horizon 8 --trainer.max_time 00:00:12:00`."),
        Table("Where a forecast of token t+1 can reach", ("next-token-ceiling-base.json",),
              "python -m experiments.next_token_ceiling --model runs/reference-bench-base --train-trace "
              "runs/base-traces/train --forecaster runs/forecast-base/sida-h8 --in-context --probe-windows 400", ceiling_rows),
        Table("In-token lookahead: a trained hidden-state probe against gate lookahead, 1-3 layers ahead",
              ("evaluate-probe-short.json",),
              "prescient evaluate --trace runs/probe-short/trace-val --train-trace runs/probe-short/trace-train --model "
              "runs/short --predictors lookahead,probe=runs/probe-short/probe,token,freq --batch-sizes 1,8 --ahead 3",
              probe_rows,
              note="Not the base model: `runs/short` is the tiny recipe trained 40 steps (validation loss 6.86 nats, "
                   "routing very skewed). The probe: `prescient trace ... --hidden-states` on 200 000 train tokens, "
                   "`prescient train --config configs/predictor/probe.yaml --trainer.max_time 00:00:18:00`; evaluated "
                   "on 50 000 validation tokens."),
        Table("What prediction and tracing cost", ("sida-latency-reference-base.json", "bench-tracing-reference-base.json"),
              f"prescient bench-predictor-latency --artifact runs/base-predictor/sida --threads 1; prescient "
              f"bench-tracing --model runs/reference-bench-base --threads 1", cost_rows),
        Table("The demo's SiDA predictor (2 forecast heads) decoding a token: the fused compiled step against the "
              "hash function's own torch step and forecasts, warm and after 90 MB of weights streamed (the "
              "runtime runs it inline, after the experts' weights)", tuple(LATENCY_DEMO.values()),
              "prescient bench-predictor-latency --artifact runs/demo/predictor/sida --threads 2 --tokens 400 "
              "[--cold-mb 90] --json ...", fused_latency_rows),
    ))


LATENCY_DEMO = {"warm": "predictor-latency-demo-warm.json", "after 90 MB": "predictor-latency-demo-cold.json"}


def fused_latency_rows() -> Rows:
    """Per condition: the fused step's median and p99 ms per token, the torch step's median, their ratio."""
    rows = []
    for condition, name in LATENCY_DEMO.items():
        d = load(name)
        rows.append([condition, num(d["ms_per_token_median"], 3), num(d["ms_per_token_p99"], 3),
                     num(d["module_ms_per_token_median"], 3),
                     num(d["module_ms_per_token_median"] / d["ms_per_token_median"])])
    return ["caches", "fused ms/token (median)", "fused p99", "torch step + forecasts ms/token", "torch / fused"], rows


HEADLINES: tuple[Headline, ...] = (
    Headline("SiDA's hash function: recall@k of the current token's experts (token table beside it)",
             lambda: f"{num(load('evaluate-base.json')['predictors']['sida']['recall_at_k'], 3)} "
                     f"({num(load('evaluate-base.json')['predictors']['token']['recall_at_k'], 3)})",
             "predictors", "evaluate-base.json"),
)
