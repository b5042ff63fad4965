"""docs/openai-api.md against the server's code: every `/metrics` name the server exports is in
its table and every name in the table is exported; every field the request models refuse at a
non-no-op value is listed with its error; every field the request models read is on the page."""

from __future__ import annotations

import re
from types import SimpleNamespace

from experiments.report import ROOT
from offload_runtime.server import schemas
from offload_runtime.server.metrics import ServerMetrics
from offload_runtime.server.prefix_cache import PrefixCache
from offload_runtime.server.scheduler import SchedulerCounters

PAGE = ROOT / "docs" / "openai-api.md"


class _Zero:
    """Runtime statistics whose every field reads 0."""

    def __getattr__(self, name: str) -> int:
        return 0


def exported() -> set[str]:
    """The metric names a loaded server exports (as scraped: counters with `_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics({"policy": "lru", "budget": "0.5", "predictor": "none"})
    metrics.scheduler = SimpleNamespace(counters=SchedulerCounters(), tokens_per_second=lambda _window: 0.0,
                                        running=0, waiting=0, stats=_Zero(), prefix_cache=PrefixCache(2**20),
                                        runtime=None)
    return {f.name + ("_total" if f.type == "counter" else "")
            for f in text_string_to_metric_families(metrics.render().decode())}


def test_the_metrics_table_is_what_the_server_exports():
    section = PAGE.read_text().split("## `/metrics`", 1)[1]
    documented = set(re.findall(r"^\| `(prescient_\w+)` \|", section, flags=re.M))
    names = exported()
    assert names - documented == set(), f"exported but not on {PAGE.name}: {sorted(names - documented)}"
    assert documented - names == set(), f"on {PAGE.name} but not exported: {sorted(documented - names)}"


def test_every_refused_field_is_listed_with_its_error():
    text = PAGE.read_text()
    base = dict(model="m", stream=False)
    cases = [schemas.CompletionRequest(prompt="p", n=2, **base), schemas.CompletionRequest(prompt="p", presence_penalty=1, **base),
             schemas.CompletionRequest(prompt="p", frequency_penalty=1, **base),
             schemas.CompletionRequest(prompt="p", logit_bias={"1": 1}, **base),
             schemas.CompletionRequest(prompt=["a", "b"], **base), schemas.CompletionRequest(prompt=[[1], [2]], **base),
             schemas.ChatRequest(messages=[{"role": "user", "content": "c"}], logprobs=True, **base),
             schemas.CompletionRequest(prompt="p", best_of=2, **base), schemas.CompletionRequest(prompt="p", suffix="s", **base),
             schemas.ChatRequest(messages=[{"role": "user", "content": "c"}], max_tokens=1, max_completion_tokens=1, **base)]
    missing = []
    for body in cases:
        field, message = body.unsupported()
        if f"`{field}`" not in text or message.split(";")[0] not in text:
            missing.append((field, message))
    assert not missing, f"refusals not on {PAGE.name}: {missing}"


def test_every_request_field_is_on_the_page():
    text = PAGE.read_text()
    fields = {*schemas.CompletionRequest.model_fields, *schemas.ChatRequest.model_fields,
              *schemas.StreamOptions.model_fields}
    missing = sorted(f for f in fields if not re.search(rf"`[^`\n]*\b{f}\b[^`\n]*`", text))
    assert not missing, f"request fields not on {PAGE.name}: {missing}"
