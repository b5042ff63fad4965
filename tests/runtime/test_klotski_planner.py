"""Klotski's planner (inequalities 4-7) against cases worked by hand."""

from __future__ import annotations

import pytest

from offload_runtime.planning.klotski import KlotskiPlanError, KlotskiTimes, layer_check, max_group_size, plan_group
from prescient.errors import CapacityError

# attention 1 s per batch, no gate time, an expert moves in 2 s and computes in 1 s per token
TIMES = KlotskiTimes(attention=1.0, gate=0.0, expert_fixed=0.0, expert_per_token=1.0, io_expert=2.0)


def test_one_expert_takes_every_token():
    """Every token picks expert 0 (top-1 of 4), the hot one: no cold expert is expected, so
    (5) n·1 ≥ 1·2 decides: n = 2."""
    plan = plan_group(TIMES, [[1.0, 0, 0, 0]], [set()], batch_size=1, max_group=16, top_k=1, hot_count=1)
    assert (plan.group_size, plan.hot_count, plan.bubble_free) == (2, 1, True)
    assert plan.checks[0].cold_expected == 0 and plan.checks[0].sides["5"] == (2.0, 2.0)


def test_a_cold_expert_half_the_time():
    """Experts 0 and 1 take half the tokens each, K = 1 (expert 0, the first of the tie):
    t_hot = n/2; len(Q) = 1 − 2^−n. (5) needs n ≥ 2; (6) n + n/2 ≥ 2·(1 + len(Q)) fails at
    n = 2 (3 < 3.5) and holds at n = 3 (4.5 ≥ 3.75); (7) 2n ≥ 2·(1 + len(Q)) holds from n = 2."""
    shares = [[0.5, 0.5, 0, 0]]
    at2 = layer_check(TIMES, shares[0], set(), 2, 1, 1)
    assert at2.sides["6"] == pytest.approx((3.0, 3.5)) and at2.sides["7"] == pytest.approx((4.0, 3.5))
    assert at2.cold_expected == pytest.approx(0.75)
    plan = plan_group(TIMES, shares, [set()], batch_size=1, max_group=16, top_k=1, hot_count=1)
    assert plan.group_size == 3 and plan.checks[0].sides["6"] == pytest.approx((4.5, 3.75))


def test_planner_picks_k_with_the_smallest_n():
    """Same shares: K = 0 needs n = 2 ((6): 2 ≥ 2·min(1, 1.5)), K = 1 needs 3, K = 2 needs 4 ((5))."""
    shares, resident = [[0.5, 0.5, 0, 0]], [set()]
    assert plan_group(TIMES, shares, resident, 1, 16, top_k=1, hot_count=0).group_size == 2
    assert plan_group(TIMES, shares, resident, 1, 16, top_k=1, hot_count=2).group_size == 4
    plan = plan_group(TIMES, shares, resident, 1, 16, top_k=1)
    assert (plan.group_size, plan.hot_count) == (2, 0)


def test_resident_experts_compute_with_the_hot_ones_and_never_move():
    """Expert 0 resident: the hot expert is 1, t_hot = n/2 (expert 0) + n/2 (expert 1); no cold
    expert; (5) n ≥ 2 decides. Batches of 2 double the tokens but not t_A."""
    plan = plan_group(TIMES, [[0.5, 0.5, 0, 0]], [{0}], batch_size=2, max_group=16, top_k=1, hot_count=1)
    assert plan.group_size == 2 and plan.checks[0].sides["6"] == pytest.approx((2 + 4, 2.0))


def test_every_layer_must_hold():
    plan = plan_group(TIMES, [[1.0, 0, 0, 0], [0.5, 0.5, 0, 0]], [set(), set()], 1, 16, top_k=1, hot_count=1)
    assert plan.group_size == 3 and [c.holds for c in plan.checks] == [True, True]


def test_memory_bound_gives_the_largest_group_with_bubbles():
    plan = plan_group(TIMES, [[0.5, 0.5, 0, 0]], [set()], batch_size=1, max_group=2, top_k=1, hot_count=1)
    assert (plan.group_size, plan.bubble_free) == (2, False)


def test_memory_and_bad_inputs_are_refused_in_one_line():
    assert max_group_size(10e9, 4e9, 1e9, batch_size=8) == 6
    with pytest.raises(CapacityError, match="cannot hold one batch of 8 requests"):
        max_group_size(4.5e9, 4e9, 1e9, batch_size=8)
    with pytest.raises(KlotskiPlanError, match="K=5 .* 0..4"):
        plan_group(TIMES, [[1.0, 0, 0, 0]], [set()], 1, 16, top_k=1, hot_count=5)
    with pytest.raises(KlotskiPlanError, match="batch size 0"):
        plan_group(TIMES, [[1.0, 0, 0, 0]], [set()], 0, 16, top_k=1)
    with pytest.raises(KlotskiPlanError, match="one row per layer"):
        plan_group(TIMES, [[1.0, 0, 0, 0], [1.0, 0]], [set(), set()], 1, 16, top_k=1)


def test_plan_cli_klotski_on_a_model_and_its_refusals(tiny_moe_dir, tmp_path, capsys, caplog):
    """`prescient plan --schedule klotski` measures the model's times and plans; a memory that
    cannot hold one batch, and a K beyond the streamed experts, are one error line, exit 2."""
    import json
    import logging

    from cli.main import main

    path = str(tiny_moe_dir("mixtral"))  # 8 experts; r_w = 0.5 streams 4
    common = ["plan", "--schedule", "klotski", "--model", path, "--hardware", "t4", "--prompt-len", "16",
              "--gen-len", "8", "--micro-batch", "2"]
    main([*common, "--json", str(tmp_path / "plan.json")])
    record = json.loads((tmp_path / "plan.json").read_text())
    assert 1 <= record["group_size"] <= record["memory"]["largest_group"] and 0 <= record["hot_count"] <= 4
    assert record["times"]["attention"] > 0 and len(record["layers"]) == 2
    assert f"n={record['group_size']}" in capsys.readouterr().out
    for extra, message in ((["--memory", "1KiB"], "cannot hold one batch of 2 requests"),
                           (["--hot-count", "5"], "K=5 hot experts")):
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
            main([*common, *extra])
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
