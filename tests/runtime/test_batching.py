"""MoE-Lightning's balanced request partition (Algorithm 2 plus the final flush)."""

import pytest

from offload_runtime.cgopipe.batching import BatchingError, min_kv_tokens, partition_requests


def test_longest_first_into_the_smallest_micro_batch():
    # lengths 10, 9, 8, 3, 2, 1 into 2 micro-batches of up to 3:
    # 10 → mb0; 9 → mb1; 8 → mb1 (9 < 10); 3 → mb0 (10 < 17); 2 → mb0 (13 < 17), mb0 closes at 3;
    # 1 → mb1, which then closes too
    lens = [3, 10, 1, 9, 2, 8]
    assert partition_requests(lens, n_micro=2, micro_batch_size=3, gen_len=4) == [[[1, 0, 4], [3, 5, 2]]]


def test_final_flush_closes_partial_micro_batches():
    assert partition_requests([5, 4, 3], n_micro=4, micro_batch_size=8, gen_len=1) == [[[0], [1], [2]]]


def test_requests_that_do_not_fit_carry_over_to_the_next_batch():
    # two micro-batches of at most 2: 6 → mb0; 5 → mb1; 4 → mb1, which closes first; 3 → mb0,
    # which closes; the fifth request waits for a second batch
    batches = partition_requests([6, 5, 4, 3, 2], n_micro=2, micro_batch_size=2, gen_len=1)
    assert batches == [[[1, 2], [0, 3]], [[4]]]


def test_kv_budget_counts_padding_and_generation():
    # budget 12 tokens per micro-batch, gen 2: a micro-batch of r requests with longest prompt p
    # holds r * (p + 2); 8 → mb0 (10); 7 → mb1 (9); 3 → mb1 would hold 2 * 9 = 18 > 12: carried
    batches = partition_requests([8, 7, 3], n_micro=2, micro_batch_size=4, gen_len=2, kv_tokens=12)
    assert batches == [[[0], [1]], [[2]]]
    for batch in batches:
        for micro in batch:
            longest = max([8, 7, 3][r] for r in micro)
            assert len(micro) * (longest + 2) <= 12


def test_every_request_lands_exactly_once():
    lens = [(7 * i) % 23 + 1 for i in range(40)]
    batches = partition_requests(lens, n_micro=3, micro_batch_size=4, gen_len=5, kv_tokens=80)
    placed = sorted(r for batch in batches for micro in batch for r in micro)
    assert placed == list(range(40))
    assert all(len(batch) <= 3 and all(1 <= len(m) <= 4 for m in batch) for batch in batches)


def test_budget_below_the_longest_request_names_the_minimum():
    with pytest.raises(BatchingError, match=f"minimum is {min_kv_tokens([30, 4], 10)}"):
        partition_requests([30, 4], n_micro=2, micro_batch_size=2, gen_len=10, kv_tokens=39)


def test_bad_sizes_are_refused():
    with pytest.raises(BatchingError):
        partition_requests([3], n_micro=0, micro_batch_size=2, gen_len=1)
    assert partition_requests([], n_micro=2, micro_batch_size=2, gen_len=1) == []
