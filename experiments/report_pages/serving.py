"""The results page `serving`: the HTTP server under 1 to 64 concurrent streaming clients."""

from __future__ import annotations

from experiments.report_pages.rows import W1T
from experiments.report_tables import Headline, Page, Rows, Table, load, num, spread


def serve_rows(name: str) -> Rows:
    d = load(name)
    rows = []
    for pred, per_clients in d["summary"].items():
        for clients, s in per_clients.items():
            rows.append([pred, clients, spread(s["tokens_per_s_median"], s["tokens_per_s_range"], 1),
                         num(s["speedup_over_1_client_median"]), num(s["ttft_p50_s_median"]),
                         num(s["latency_p50_s_median"]), s["refused"], s["lost"]])
    return ["predictor", "clients", "tokens/s median (range)", "× 1 client", "time to first token p50 (s)",
            "latency p50 (s)", "refused", "lost"], rows


def page() -> Page:
    cmd = ("{W1T} prescient bench-serve --model runs/reference-bench --predictors {p} --policy lru --budget {b} --clients "
           "1,4,16,64 --repeats 3 --max-tokens 32 --json ... --plot ...")
    return Page("serving", "Serving under load", f"""
The server answers every request under concurrent streaming load (none refused, lost or hung) and
batching requests together raises throughput with the number of clients. On two CPU cores the
gain at 16 clients stays near 2× even with every expert resident: each expert is a memory-bound
FFN, and a batch of sampled sequences touches most experts per step, so batching only pays once a
step covers nearly every expert for many tokens. SiDA's prefetching adds a few percent at every load.
""", (
        Table("Half of the experts in slots", ("bench-serve-base.json",),
              cmd.format(p="none,sida=runs/base-predictor/sida", b="0.5", W1T=W1T), lambda: serve_rows("bench-serve-base.json")),
        Table("Every expert resident (nothing loaded after the warm-up)", ("bench-serve-resident-base.json",),
              cmd.format(p="none", b="1.0", W1T=W1T), lambda: serve_rows("bench-serve-resident-base.json")),
        Table("guidellm 0.8.1 (the vLLM project's load generator), concurrent profile, against `prescient serve "
              "--model runs/tb --memory 0.65GB` (no predictor)", GUIDELLM, load(GUIDELLM[0])["command"], guidellm_rows),
    ))


GUIDELLM = ("guidellm-tb-0.65GB.json", "guidellm-tb-0.65GB-streams2.json", "guidellm-tb-0.65GB-streams8.json")


def guidellm_rows() -> Rows:
    """Per stream count: guidellm's request outcomes, and its token sums beside the server's /metrics."""
    rows = []
    for streams, r in load(GUIDELLM[0])["runs"].items():
        rows.append([streams.split("=")[1], r["successful"], r["errored"], r["incomplete"],
                     f"{r['guidellm_prompt_tokens']} / {int(r['server_prompt_tokens'])}",
                     f"{r['guidellm_output_tokens']} / {int(r['server_completion_tokens'])}", num(r["output_tokens_per_s"])])
    return ["streams", "successful", "errored", "incomplete", "prompt tokens: guidellm / server",
            "output tokens: guidellm / server", "output tokens/s"], rows


HEADLINES: tuple[Headline, ...] = (
    Headline("Serving: 16 concurrent streaming clients against one, tokens/s (SiDA + LRU, half the experts, page cache kept)",
             lambda: f"{num(load('bench-serve-base.json')['summary']['sida']['16']['speedup_over_1_client_median'])}×",
             "serving", "bench-serve-base.json"),
)
