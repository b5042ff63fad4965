"""`/metrics`: the server's and the offloading runtime's own numbers, in the Prometheus text format.

Every series carries the labels `policy`, `budget` and `predictor`, so the scrapes of servers
run with different settings line up side by side; a replica of several (`ray_replicas`) adds
`replica`, and `merge_expositions` puts the replicas' scrapes into one. Request timings are histograms observed as
requests finish; everything else is read at scrape time from the scheduler's counters and from
the runtime statistics it snapshots after each forward (`OffloadRuntime.stats()`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from offload_runtime.server.scheduler import Request, Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_RATE_WINDOW_S = 10.0

# (metric name, help, RuntimeStats field); all counters
_FORWARDS = ("model_forwards", "forwards of the model (prefills and decode steps)", "forwards")
_RUNTIME_COUNTERS = [
    ("expert_cache_hits", "expert accesses served by a resident expert", "hits"),
    ("expert_cache_misses", "expert accesses that needed a load", "misses"),
    ("expert_cache_evictions", "experts evicted from the slots", "evictions"),
    ("prefetches_issued", "experts inserted by a predictor's prefetch", "prefetch_inserts"),
    ("prefetches_used", "prefetched experts used before their eviction", "prefetch_hits"),
    ("prefetches_wasted", "prefetched experts evicted unused", "wasted_prefetches"),
    ("expert_loads", "expert copies into slots (demand and prefetch)", "loads"),
    ("expert_bytes_moved", "bytes of expert weights copied into slots", "bytes_moved"),
    ("expert_stall_seconds", "seconds the inference thread waited on expert loads", "stall_seconds"),
    ("hash_tables_late", "forwards whose predicted experts were not ready at their first MoE layer", "late_tables"),
    ("hash_tables_on_time", "forwards whose predicted experts were ready in time", "tables_on_time"),
    ("hash_builder_failures", "failures of the hash-building thread (serving went on with demand loads)",
     "predictor_failures"),
    _FORWARDS,
    ("expert_fine_uses", "mixed precision: expert accesses computed with an expert's fine copy", "fine_accesses"),
    ("expert_slots_given_back", "slots the memory guard gave back: the process re-read its own pages under --memory",
     "slots_given_back"),
    ("prediction_paused_forwards", "forwards run with the predictor asleep (the prediction guard: acting "
     "would have loaded more experts than LRU, or cost more time than it saved)", "prediction_paused_forwards"),
    ("prediction_probe_forwards", "forwards run with the predictions in the prediction guard's shadow only, "
     "probing whether acting on them would pay", "prediction_probe_forwards"),
    ("predictor_seconds", "seconds the inference thread spent on predictions", "predictor_seconds"),
]


class ServerMetrics:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.registry = CollectorRegistry(auto_describe=True)
        self.scheduler: Scheduler | None = None  # set once the model is loaded
        self.ttft = Histogram("prescient_time_to_first_token_seconds", "arrival to first generated token",
                              tuple(labels), registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram("prescient_request_latency_seconds", "arrival to last token", tuple(labels),
                                 registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.registry.register(self)

    def observe_finished(self, request: Request) -> None:
        """Called by the inference thread as each request ends."""
        if request.first_token_at is not None:
            self.ttft.labels(**self.labels).observe(request.first_token_at - request.arrived)
            self.latency.labels(**self.labels).observe(request.finished_at - request.arrived)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        names = list(self.labels)
        values = list(self.labels.values())

        def family(kind, name, doc, value, extra: dict[str, str] | None = None):
            f = kind(f"prescient_{name}", doc, labels=names + list(extra or {}))
            f.add_metric(values + list((extra or {}).values()), value)
            return f

        s = self.scheduler
        yield family(GaugeMetricFamily, "ready", "1 once the model and predictor are loaded", float(s is not None))
        if s is None:
            return
        c = s.counters
        requests = CounterMetricFamily("prescient_requests", "requests finished, by finish reason",
                                       labels=names + ["finish_reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            requests.add_metric(values + [reason], c.finished.get(reason, 0))
        yield requests
        yield family(CounterMetricFamily, "requests_rejected", "requests refused with 429 (queue full)", c.rejected)
        yield family(CounterMetricFamily, "prompt_tokens", "prompt tokens prefilled", c.prompt_tokens)
        yield family(CounterMetricFamily, "prompt_tokens_cached",
                     "prompt tokens whose KV came from the prefix cache (not prefilled)", c.prompt_tokens_cached)
        if s.prefix_cache is not None:
            yield family(GaugeMetricFamily, "prefix_cache_bytes", "bytes of KV in the prefix cache", s.prefix_cache.bytes)
            yield family(GaugeMetricFamily, "prefix_cache_entries", "sequences in the prefix cache", len(s.prefix_cache))
        yield family(CounterMetricFamily, "completion_tokens", "tokens generated", c.completion_tokens)
        yield family(CounterMetricFamily, "decode_steps", "batched decode forwards", c.decode_steps)
        yield family(GaugeMetricFamily, "tokens_per_second",
                     f"tokens generated per second over the last {_RATE_WINDOW_S:g} s",
                     s.tokens_per_second(_RATE_WINDOW_S))
        yield family(GaugeMetricFamily, "mean_decode_batch", "mean rows per decode step since start",
                     c.decode_rows / c.decode_steps if c.decode_steps else 0.0)
        yield family(GaugeMetricFamily, "requests_running", "requests in the decoding batch", s.running)
        yield family(GaugeMetricFamily, "requests_waiting", "requests queued for the batch", s.waiting)
        stats = s.stats
        if stats is None:  # a model served without offloading
            return
        if _every_expert_resident(s):  # no cache runs: its accesses are not counted, so none is reported
            yield family(CounterMetricFamily, *_FORWARDS[:2], stats.forwards)
        else:
            yield from self._cache_series(family, stats, c)
        yield family(GaugeMetricFamily, "expert_slots", "expert slots in fast memory", stats.slots)
        yield family(GaugeMetricFamily, "expert_slot_bytes", "bytes of the expert slots", stats.slot_bytes)


    @staticmethod
    def _cache_series(family, stats, counters):
        """The expert cache's and the predictor's series (an offloaded model's)."""
        for name, doc, field in _RUNTIME_COUNTERS:
            yield family(CounterMetricFamily, name, doc, getattr(stats, field))
        yield family(CounterMetricFamily, "prefill_expert_cache_hits", "of expert_cache_hits, those in prefills",
                     counters.prefill_expert_hits)
        yield family(CounterMetricFamily, "prefill_expert_cache_misses", "of expert_cache_misses, those in prefills",
                     counters.prefill_expert_misses)
        yield family(GaugeMetricFamily, "expert_cache_hit_rate", "hits / accesses since start", stats.hit_rate)


def _every_expert_resident(scheduler: Scheduler) -> bool:
    """Whether the memory cap holds every expert (the plain model, copied or mapped): no cache runs."""
    plan = scheduler.runtime.memory_plan if scheduler.runtime is not None else None
    return plan is not None and plan.resident


def merge_expositions(texts: list[str]) -> bytes:
    """One Prometheus text exposition of several (the replicas' /metrics, each labelled by its
    `replica`): each metric's help and type once, then every exposition's samples of it."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of families already made (what `merge_expositions` renders)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
