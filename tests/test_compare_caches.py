"""`prescient compare-caches`: records and their relations (Belady bounds demand policies, oracle
prefetching stalls less than demand misses), JSON and PNG through the CLI, a causal replay of a
bidirectional predictor, and the errors for bad input, on traces written with `TraceWriter`."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from cli.main import main as cli_main
from experiments.compare_caches import CompareCachesError, compare_caches, format_table
from experiments.predictor_scores import trace_scores
from predictor import PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes, TokenTablePredictor
from predictor.artifact import load_predictor, save_predictor
from prescient.errors import CapacityError, FingerprintMismatchError
from prescient.fingerprint import ModelFingerprint
from prescient.traces import TraceManifest, TraceWriter, load_trace

VOCAB, LAYERS, EXPERTS, K, TOP_T = 40, 3, 8, 2, 6
FP = ModelFingerprint("synthetic", LAYERS, EXPERTS, K, VOCAB, "0" * 16)
OTHER_FP = dataclasses.replace(FP, weights_hash="f" * 16)
RECORD_FIELDS = {"policy", "capacity", "capacity_fraction", "batch_size", "prefetch", "hit_rate", "stall_rate",
                 "accesses", "hits", "misses", "stalls", "late_prefetches", "prefetch_inserts", "prefetch_hits",
                 "wasted_prefetches", "evictions", "layers_ahead", "transfer_per_step", "seconds", "trace_fingerprint"}


def write_trace(path, seed=0, fingerprint=FP, tokens=None):
    """Sequences of 16-20 random tokens; each layer's router logits depend mostly on the token,
    so token tables predict them well but not perfectly. `tokens` replaces the sequences."""
    gen = torch.Generator().manual_seed(seed)
    by_token = torch.randn(LAYERS, VOCAB, EXPERTS, generator=torch.Generator().manual_seed(99)) * 2
    sequences = tokens or [torch.randint(0, VOCAB, (16 + i % 5,), generator=gen) for i in range(14)]
    ids = torch.cat(sequences)
    logits = by_token[:, ids].transpose(0, 1) + torch.randn(len(ids), LAYERS, EXPERTS, generator=gen)
    top = logits.topk(TOP_T, dim=-1)
    writer = TraceWriter(path, TraceManifest(fingerprint, f"synthetic-{seed}", "validation", TOP_T))
    writer.add_shard({
        "seq_id": torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)]).long(),
        "position": torch.cat([torch.arange(len(s)) for s in sequences]).int(),
        "token_id": ids.long(),
        "topk_ids": top.indices[..., :K].to(torch.int16),
        "topt_ids": top.indices.to(torch.int16),
        "topt_logits": top.values.float(),
    }, sequences=len(sequences))
    writer.finish()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    return write_trace(root / "eval", seed=0), write_trace(root / "train", seed=1)


@pytest.fixture(scope="module")
def result(traces):
    return compare_caches(traces[0], capacities=(0.5, 0.75, 12), batch_sizes=(1, 3), predictor="oracle",
                          train_trace=traces[1], progress=False)


def runs_by(result):
    return {(r["batch_size"], r["policy"], r["capacity"], r["prefetch"]): r for r in result["runs"]}


def test_one_record_per_run_with_every_field(result):
    assert len(result["runs"]) == 2 * 2 * 6 * 3  # batch sizes x (demand, prefetch) x policies x capacities
    for r in result["runs"]:
        assert RECORD_FIELDS <= set(r)
        assert r["hits"] + r["misses"] == r["accesses"] > 0
        assert r["hit_rate"] == pytest.approx(r["hits"] / r["accesses"])
        assert r["stall_rate"] == pytest.approx(r["stalls"] / r["accesses"])
        assert r["capacity"] == round(r["capacity_fraction"] * LAYERS * EXPERTS)
        assert r["prefetch_inserts"] == 0 if not r["prefetch"] else r["prefetch_inserts"] > 0
    assert result["settings"]["capacity_slots"] == [12, 18, 12]  # a fraction of L*E = 24, or a count
    assert result["trace"]["fingerprint"] == FP.to_dict()
    assert result["predictor"]["name"] == "oracle" and result["static_fit_on"] == str(result["train_trace"]["dir"])


def test_belady_bounds_every_demand_policy(result):
    runs = runs_by(result)
    for (b, policy, n, prefetch), r in runs.items():
        if not prefetch:
            assert runs[b, "belady", n, False]["hit_rate"] >= r["hit_rate"], (b, policy, n)


def test_oracle_prefetch_stalls_less_than_demand_misses(result):
    runs = runs_by(result)
    for (b, policy, n, prefetch), r in runs.items():
        if prefetch:
            demand = runs[b, policy, n, False]
            assert r["accesses"] == demand["accesses"]
            assert r["stall_rate"] <= 1 - demand["hit_rate"], (b, policy, n)
            if policy == "belady":  # room for two layer-steps, instant transfers: nothing waits
                assert r["stalls"] == 0 and r["prefetch_hits"] == r["prefetch_inserts"]


def test_named_predictor_fit_on_the_replayed_trace_says_so(traces):
    res = compare_caches(traces[0], ("lru", "static"), (0.5,), (1,), predictor="token", progress=False)
    assert res["predictor_fit_on"] == "same trace (optimistic)" == res["static_fit_on"]
    assert res["predictor"]["kind"] == "token-table" and res["train_trace"] is None
    assert res["predictor"]["sees"] == "the token alone"


def test_correlation_table_one_layer_ahead_uses_the_true_previous_layer(traces):
    res = compare_caches(traces[0], ("lru",), (0.5,), (1,), predictor="corr", train_trace=traces[1], progress=False)
    assert res["predictor"]["kind"] == "klotski-correlation" and "true experts at layer l" in res["predictor"]["sees"]
    assert res["predictor_fit_on"] == str(traces[1])


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path, traces, capsys):
    out, png = tmp_path / "caches.json", tmp_path / "caches.png"
    cli_main(["compare-caches", "--trace", str(traces[0]), "--train-trace", str(traces[1]), "--predictor", "corr",
              "--policies", "lru,mrs,belady", "--capacity", "0.5,1", "--batch-size", "1,2", "--layers-ahead", "all",
              "--transfer-per-step", "1", "--json", str(out), "--plot", str(png)])
    table = capsys.readouterr().out
    assert "belady" in table and "stall+pf" in table
    res = json.loads(out.read_text())
    assert res["settings"]["layers_ahead"] is None and res["settings"]["transfer_per_step"] == 1
    assert {r["capacity"] for r in res["runs"]} == {12, 24}
    assert {(r["prefetch"], r["layers_ahead"]) for r in res["runs"]} == {(False, None), (True, None)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_a_bidirectional_predictor_is_stepped_and_never_sees_ahead(tmp_path):
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4, bidirectional=True)
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(torch.randn(VOCAB, 16), LAYERS, EXPERTS, sizes)
    pred = load_predictor(save_predictor(SiDAPredictor(hash_fn, PredictorMeta("sida", FP, dataclasses.asdict(sizes))),
                                         tmp_path / "sida"), fingerprint=FP)
    prefix = torch.tensor([3, 1, 4, 1, 5])
    one = load_trace(write_trace(tmp_path / "a", tokens=[torch.cat([prefix, torch.tensor([9, 2, 6])])]))
    two = load_trace(write_trace(tmp_path / "b", tokens=[torch.cat([prefix, torch.tensor([8, 8, 0])])]))
    scores_one, info = trace_scores(pred, one, decoding=True)
    scores_one, scores_two = scores_one.numpy(), trace_scores(pred, two, decoding=True)[0].numpy()
    assert info["causal"] is True
    torch.testing.assert_close(torch.from_numpy(scores_one[:5]), torch.from_numpy(scores_two[:5]))
    whole = pred.predict(one["token_id"][None])[0]  # bidirectional: the prefix sees the future here
    assert not torch.allclose(whole[:5], torch.from_numpy(scores_one[:5]))


def test_capacity_below_one_layer_step_names_the_minimum(traces):
    with pytest.raises(CapacityError, match=r"batch size 3: the minimum is \d+ slots"):
        compare_caches(traces[0], ("lru",), (2,), (3,), progress=False)


def test_capacity_too_small_only_for_a_larger_batch_is_skipped_and_said(traces):
    res = compare_caches(traces[0], ("lru",), (2, 12), (1, 3), progress=False)
    assert res["min_capacity"]["1"] == K and res["min_capacity"]["3"] > 2
    assert res["skipped"] == [{"batch_size": 3, "capacity": 2, "capacity_given": 2,
                               "min_capacity": res["min_capacity"]["3"]}]
    assert {(r["batch_size"], r["capacity"]) for r in res["runs"]} == {(1, 2), (1, 12), (3, 12)}
    assert "skipped: capacity 2 (2 slots) at batch size 3" in format_table(res)


def test_capacity_slot_count_below_top_k_reaches_the_user(traces, tmp_path, caplog):
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_info:
        cli_main(["compare-caches", "--trace", str(traces[0]), "--capacity", "0.04", "--batch-size", "1",
                  "--json", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2
    assert "the minimum is 2 slots" in caplog.text
    assert not (tmp_path / "x.json").exists()


def test_artifact_of_another_model_names_both_fingerprints(tmp_path, traces):
    other = load_trace(write_trace(tmp_path / "other", fingerprint=OTHER_FP))
    artifact = save_predictor(TokenTablePredictor.from_trace(other), tmp_path / "other-table")
    with pytest.raises(FingerprintMismatchError) as err:
        compare_caches(traces[0], ("lru",), (0.5,), (1,), predictor=artifact, progress=False)
    assert "0" * 16 in str(err.value) and "f" * 16 in str(err.value)


def test_learned_eviction_with_the_oracles_forecasts_closes_most_of_the_gap_to_belady(traces):
    """The oracle forecasts with certainty: learned eviction then measures perfect foresight (here
    76% and 90% of the LRU → Belady gap; read as k·softmax, its scores would give 59% and 81%)."""
    res = compare_caches(traces[0], ("lru", "learned-belady", "belady"), (0.25, 0.5), (1,), predictor="oracle",
                         progress=False)
    demand = {(r["policy"], r["capacity"]): r["misses"] for r in res["runs"] if not r["prefetch"]}
    for slots in res["settings"]["capacity_slots"]:
        lru, learned, belady = (demand[policy, slots] for policy in ("lru", "learned-belady", "belady"))
        assert belady <= learned and (lru - learned) >= 0.7 * (lru - belady)


def test_unknown_policy_lists_the_known_ones(traces):
    with pytest.raises(CompareCachesError) as err:
        compare_caches(traces[0], ("lru", "arc"), (0.5,), (1,), progress=False)
    assert "'arc'" in str(err.value)
    for name in ("lru", "lfu", "fifo", "mrs", "belady", "static"):
        assert name in str(err.value)


def test_unknown_predictor_name_and_bad_capacity(traces):
    with pytest.raises(CompareCachesError, match="oracle"):
        compare_caches(traces[0], ("lru",), (0.5,), (1,), predictor="sida-that-is-not-there", progress=False)
    with pytest.raises(CompareCachesError, match=r"\(0, 1\]"):
        compare_caches(traces[0], ("lru",), (1.5,), (1,), progress=False)


def test_a_timed_comparison_plots_simulated_tokens_per_s(tmp_path, monkeypatch):
    """The demo's plot shows what a reader should compare: each policy's time-true tokens/s (a
    count-only prefetch hit rate can sit above Belady's bound), read from the JSON as it is."""
    import matplotlib.figure

    from experiments.compare_caches import plot_compare_caches

    drawn = []
    save = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        drawn.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    path = Path(__file__).resolve().parent.parent / "results" / "demo-compare-caches-fresh-clone.json"
    result = json.loads(path.read_text())
    assert plot_compare_caches(result, tmp_path / "caches.png").stat().st_size > 0
    ax = drawn[0].axes[0]
    assert ax.get_ylabel() == "simulated tokens/s"
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    b = result["settings"]["batch_sizes"][0]
    for label, policy, prefetch in (("lru", "lru", False), ("belady (demand bound)", "belady", False),
                                    ("lru + sida prefetch", "lru", True)):
        runs = sorted((r for r in result["runs"] if (r["batch_size"], r["policy"], r["prefetch"]) == (b, policy, prefetch)),
                      key=lambda r: r["capacity"])
        assert lines[label] == [r["tokens_per_s"] for r in runs]
