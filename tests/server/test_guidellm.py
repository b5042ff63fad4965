"""guidellm 0.8.1 (the vLLM project's load generator) run as a user runs it against `prescient
serve` over a tiny Mixtral with half its experts offloaded: its concurrent profile at 2 streams,
synthetic prompts of 32 tokens and 16 output tokens; every request succeeds, and the tokens it
counts are the tokens the server's /metrics counted. Skipped where guidellm is not installed
(`pip install 'moe-prescient[load]'`)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.server.serving import MODEL, free_port, serve_process

pytest.importorskip("guidellm")
pytestmark = pytest.mark.slow  # a server process and guidellm's, ~40 s
REQUESTS, STREAMS = 8, 2


def counters(url: str) -> dict[str, float]:
    """The server's token and request counters, summed over their labels."""
    names = ("prescient_prompt_tokens_total", "prescient_completion_tokens_total", "prescient_requests_total")
    totals = dict.fromkeys(names, 0.0)
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def guidellm(url: str, tokenizer, out, streams: int, requests: int) -> dict:
    """`guidellm run`'s concurrent profile against `url`; its JSON report's one benchmark."""
    subprocess.run([sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={url},model={MODEL}",
                    "--profile", f"kind=concurrent,streams={streams}",
                    "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                    "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                    "--constraint", f"kind=max_requests,count={requests}",
                    "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                   check=True, timeout=300, capture_output=True, text=True)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return benchmark


def test_guidellms_concurrent_profile_has_no_errors_and_the_servers_token_counts(tiny_moe_dir, tmp_path):
    model_dir, port = tiny_moe_dir("mixtral"), free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_process(model_dir, port, "--budget", "50%", "--max-batch", "8"):
        before = counters(url)
        benchmark = guidellm(url, model_dir, tmp_path / "guidellm.json", STREAMS, REQUESTS)
        after = counters(url)
    requests = benchmark["requests"]
    assert not requests["errored"] and not requests["incomplete"], requests
    done = requests["successful"]
    assert len(done) == REQUESTS
    served = {name: after[name] - before[name] for name in after}
    assert served["prescient_requests_total"] == REQUESTS
    assert served["prescient_prompt_tokens_total"] == sum(r["prompt_tokens"] for r in done)
    assert served["prescient_completion_tokens_total"] == sum(r["output_tokens"] for r in done) == 16 * REQUESTS
