"""`experiments.prefetch_sweep`: every configuration replays every prompt's sequence on the clock;
with certain forecasts (the oracle's routing as the predictor) and slots to spare beyond a token's
experts, cross-token prefetch alone prefetches, wastes little and stalls less than learned eviction
alone, and the oracle stalls less than LRU."""

from __future__ import annotations

from cache.timing import LinkTiming
from experiments.prefetch_sweep import THRESHOLDS, sweep
from prescient.traces import load_trace
from tests.test_compare_caches import write_trace


def test_sweep_replays_each_prompt_and_the_oracle_bounds_it(tmp_path):
    trace = load_trace(write_trace(tmp_path / "trace"))
    prompts = len(trace["seq_id"].unique())
    timing = LinkTiming(1e-3, 1.0, 1.0 / 3e-3)  # a copy takes three layers' compute
    (result,) = sweep(trace, "oracle", [12], timing)  # a token uses 6
    rows = {row["config"]: row for row in result["configs"]}
    assert set(rows) == {"lru", "learned", "learned+in-token+next>=0.5", "oracle",
                         *(f"learned+next>={least}" for least in THRESHOLDS)}
    assert all(len(row["prompts"]) == prompts for row in rows.values())
    assert rows["lru"]["over_lru"]["median"] == 1.0
    assert sum(p["prefetch_loads"] for p in rows["lru"]["prompts"] + rows["learned"]["prompts"]) == 0
    alone, learned = rows["learned+next>=0.9"]["prompts"], rows["learned"]["prompts"]  # nothing in-token
    prefetched = sum(p["prefetch_loads"] for p in alone)
    assert prefetched > 0 and 10 * sum(p["wasted_loads"] for p in alone) < prefetched
    assert sum(p["stall_ms_per_token"] for p in alone) < sum(p["stall_ms_per_token"] for p in learned)
    oracle, lru = rows["oracle"]["prompts"], rows["lru"]["prompts"]
    assert sum(p["stall_ms_per_token"] for p in oracle) < sum(p["stall_ms_per_token"] for p in lru)
