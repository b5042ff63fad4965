"""LinkTiming calibrated from a runtime bench JSON and from a hardware profile with a model
config; the wrong model refused; compare_caches with a timing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cache.timing import LinkTiming
from experiments.compare_caches import CompareCachesError, compare_caches
from experiments.timing_calibration import (
    TimingCalibrationError,
    load_timing,
    timing_from_bench,
    timing_from_profile,
)
from offload_runtime.planning.hardware import HardwareProfile, Processor
from prescient.errors import FingerprintMismatchError
from prescient.fingerprint import ModelFingerprint
from prescient.traces import TraceManifest, TraceWriter

FP = ModelFingerprint("mixtral", 4, 16, 2, 4096, "9dc7f8dfad7ae147")
OTHER_FP = dataclasses.replace(FP, weights_hash="f" * 16)


def run(label, predictor, bytes_moved, stall, prefetch_loads=0):
    return {"label": label, "predictor": predictor, "bytes_moved": bytes_moved, "stall_seconds": stall,
            "stats": {"prefetch_loads": prefetch_loads}}


def bench_json(tmp_path, fingerprint=None, runs=None):
    model = {"dir": "runs/bench-model", "expert_bytes": 1000, "n_moe_layers": 4, "n_experts": 16, "top_k": 2}
    if fingerprint is not None:
        model["fingerprint"] = fingerprint.to_dict()
    data = {"settings": {"transfer_workers": 1}, "model": model,
            "baselines": {"all_resident": {"decode_seconds": 2.0, "decode_tokens": 50}},
            "runs": runs if runs is not None else [
                run("none+lru@0.5", "none", 3000, 2.0), run("none+lru@0.25", "none", 5000, 6.0),
                run("sida+mrs@0.5", "sida", 9000, 1.0, prefetch_loads=4)]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_a_bench_json_gives_compute_from_all_resident_and_the_link_from_demand_runs(tmp_path):
    cal = timing_from_bench(bench_json(tmp_path), fingerprint=FP)
    assert cal.timing == LinkTiming(2.0 / 50 / 4, 1000, (3000 + 5000) / (2.0 + 6.0))  # the sida run left out
    assert cal.source["link_runs"] == ["none+lru@0.5", "none+lru@0.25"]
    assert "shape only" in cal.source["fingerprint"]
    assert load_timing(bench_json(tmp_path)).timing == cal.timing  # recognised as a bench JSON


def test_a_bench_json_of_another_model_names_both_fingerprints(tmp_path):
    path = bench_json(tmp_path, fingerprint=OTHER_FP)
    with pytest.raises(FingerprintMismatchError) as info:
        timing_from_bench(path, fingerprint=FP)
    assert FP.weights_hash in str(info.value) and OTHER_FP.weights_hash in str(info.value)
    assert "matches" in timing_from_bench(path, fingerprint=OTHER_FP).source["fingerprint"]


def test_a_bench_json_without_a_fingerprint_must_have_the_same_moe_shape(tmp_path):
    with pytest.raises(TimingCalibrationError, match="n_experts=16.*E=8"):
        timing_from_bench(bench_json(tmp_path), fingerprint=dataclasses.replace(FP, n_experts=8))


@pytest.mark.parametrize("runs, match", [
    ([run("sida+mrs@0.5", "sida", 9000, 1.0, prefetch_loads=4)], "no run without prefetching"),
    ([run("none+lru@1.0", "none", 0, 0.0)], "no run without prefetching"),
])
def test_a_bench_json_without_demand_loads_is_refused(tmp_path, runs, match):
    with pytest.raises(TimingCalibrationError, match=match):
        timing_from_bench(bench_json(tmp_path, runs=runs))


def test_unreadable_calibration_files_are_refused(tmp_path):
    with pytest.raises(TimingCalibrationError, match="does not exist"):
        timing_from_bench(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TimingCalibrationError, match="not JSON"):
        timing_from_bench(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps({"runs": [], "baselines": {}, "model": {}}))
    with pytest.raises(TimingCalibrationError, match="lacks 'all_resident'"):
        load_timing(tmp_path / "partial.json")


def model_config(tmp_path, intermediate=256):
    config = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": intermediate,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_local_experts": 16, "num_experts_per_tok": 2, "vocab_size": 4096, "dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def cpu_profile(flops):
    """A CPU whose memory is never the bound, so compute time is FLOPs / peak."""
    return HardwareProfile("test-cpu", Processor(flops, 1e18, 64e9), disk_to_cpu=5e8)


def test_a_profile_gives_the_link_from_disk_to_cpu_and_compute_from_cpu_flops(tmp_path):
    config = model_config(tmp_path)
    slow, fast = (timing_from_profile(cpu_profile(f), config, fingerprint=FP) for f in (1e9, 2e9))
    assert slow.timing.expert_bytes == 3 * 128 * 256 * 4 and slow.timing.link_bytes_per_s == 5e8
    assert slow.timing.layer_compute_s == pytest.approx(2 * fast.timing.layer_compute_s)
    wider = timing_from_profile(cpu_profile(1e9), model_config(tmp_path, intermediate=512), fingerprint=FP)
    assert wider.timing.layer_compute_s > slow.timing.layer_compute_s  # bigger experts compute longer


def test_a_profile_with_a_random_read_curve_gives_the_link_at_the_depth_the_runtime_keeps(tmp_path):
    from offload_runtime.planning.link_profile import ReadCurve

    expert = 3 * 128 * 256 * 4
    curve = ReadCurve(expert, (1, 2, 4, 8), (4e8, 7e8, 9.6e8, 1e9), ((4e8,), (7e8,), (9.6e8,), (1e9,)), 4)
    profile = dataclasses.replace(cpu_profile(1e9), random_reads=curve)
    t = timing_from_profile(profile, model_config(tmp_path), fingerprint=FP).timing
    assert (t.reads_in_flight, t.depth_rates, t.link_bytes_per_s) == (4, (4e8, 7e8, 7e8, 9.6e8), 9.6e8)
    assert t.copy_s[0] == pytest.approx(expert / 4e8) and t.copy_s[3] == pytest.approx(4 * expert / 9.6e8)
    # compute-bound CPU: the routed experts' op is top-k x 6 x hidden x intermediate FLOPs of the layer-step
    assert t.expert_compute_s == pytest.approx(2 * 6 * 128 * 256 / 1e9) and t.expert_compute_s < t.layer_compute_s
    two = timing_from_profile(profile, model_config(tmp_path), fingerprint=FP, reads_in_flight=2).timing
    assert (two.reads_in_flight, two.link_bytes_per_s) == (2, 7e8)
    with pytest.raises(TimingCalibrationError, match="no random-read curve"):
        timing_from_profile(cpu_profile(1e9), model_config(tmp_path), reads_in_flight=2)


def test_a_profile_needs_the_model_config_and_the_models_shape(tmp_path):
    profile = tmp_path / "profile.json"
    cpu_profile(1e9).save(profile)
    with pytest.raises(TimingCalibrationError, match="give the model's config"):
        load_timing(profile)
    assert load_timing(profile, model_config=model_config(tmp_path)).timing.link_bytes_per_s == 5e8
    with pytest.raises(TimingCalibrationError, match="num_local_experts|n_experts=16"):
        timing_from_profile(profile, model_config(tmp_path), fingerprint=dataclasses.replace(FP, n_experts=8))
    with pytest.raises(TimingCalibrationError, match="no GPU"):
        timing_from_profile(profile, model_config(tmp_path), store="host")


def write_trace(path, fingerprint, n_sequences=6, length=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = n_sequences * length
    logits = torch.randn(n, fingerprint.n_moe_layers, fingerprint.n_experts, generator=gen)
    top = logits.topk(6, dim=-1)
    writer = TraceWriter(path, TraceManifest(fingerprint, "synthetic", "validation", 6))
    writer.add_shard({
        "seq_id": torch.arange(n_sequences).repeat_interleave(length),
        "position": torch.arange(length).repeat(n_sequences).int(),
        "token_id": torch.randint(0, fingerprint.vocab_size, (n,), generator=gen),
        "topk_ids": top.indices[..., :fingerprint.top_k].to(torch.int16),
        "topt_ids": top.indices.to(torch.int16),
        "topt_logits": top.values.float(),
    }, sequences=n_sequences)
    writer.finish()
    return path


def test_compare_caches_with_a_timing_adds_the_clock_to_every_record(tmp_path):
    trace = write_trace(tmp_path / "trace", FP)
    timing = LinkTiming(0.01, 1000, 1e5)
    kwargs = {"policies": ("lru", "belady"), "capacities": (0.25, 0.5), "batch_sizes": (1,),
              "predictor": "oracle", "progress": False}
    timed, counted = compare_caches(trace, timing=timing, expert_pipelines=(False, True), **kwargs), \
        compare_caches(trace, **kwargs)
    assert timed["settings"]["link_timing"] == timing.to_dict() and counted["settings"]["link_timing"] is None
    assert len(timed["runs"]) == 16 and [r["expert_pipeline"] for r in timed["runs"][:2]] == [False, True]
    piped = timed["runs"][1::2]
    timed["runs"] = timed["runs"][::2]  # the per-layer model's runs
    for t, p in zip(timed["runs"], piped):  # the same decisions; each expert computed as it lands is never slower
        assert (t["hits"], t["prefetch_inserts"]) == (p["hits"], p["prefetch_inserts"])
        assert p["simulated_seconds"] <= t["simulated_seconds"] + 1e-12
    on_the_clock = {"seconds", "stalls", "late_prefetches", "stall_rate", "expert_pipeline"}  # instant: never late
    for t, c in zip(timed["runs"], counted["runs"]):
        assert {k: t[k] for k in c if k not in on_the_clock} == {k: v for k, v in c.items() if k not in on_the_clock}
        assert t["stalls"] == t["misses"] + t["late_prefetches"]
        assert t["tokens"] == 180 and t["tokens_per_s"] == pytest.approx(1 / t["seconds_per_token"])
        assert t["stall_seconds_per_token"] >= t["misses"] * 0.01 / 180 - 1e-12
        assert t["bytes_moved_per_token"] >= t["misses"] * 1000 / 180
        assert "simulated_seconds" not in c
    with pytest.raises(CompareCachesError, match="not both"):
        compare_caches(trace, timing=timing, transfer_per_step=2, **kwargs)
    with pytest.raises(CompareCachesError, match="give --timing"):
        compare_caches(trace, hide_only=True, **kwargs)
    slow = LinkTiming(0.01, 1000, 1000)  # a copy takes 1 s, a token 0.04 s: nothing can hide
    gated = compare_caches(trace, timing=slow, hide_only=True, **kwargs)
    assert gated["settings"]["hide_only"]
    demand = {(r["policy"], r["capacity"]): r for r in gated["runs"] if not r["prefetch"]}
    for r in (r for r in gated["runs"] if r["prefetch"]):
        assert r["prefetch_inserts"] == 0 and r["misses"] == demand[r["policy"], r["capacity"]]["misses"]
