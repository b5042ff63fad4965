"""Belady's offline optimum hits at least as often as every demand policy, on any sequence."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import ExpertCache, make_policy

keys = st.tuples(st.integers(0, 1), st.integers(0, 5))


def hits(policy, sequence, capacity, per_layer, scores):
    cache = ExpertCache(capacity, policy, per_layer=per_layer)
    count = 0
    for key, step_scores in zip(sequence, scores):
        cache.on_step(key[0], step_scores)
        count += cache.access(key)
    return count


@settings(max_examples=150, deadline=None)
@given(
    sequence=st.lists(keys, min_size=1, max_size=60),
    capacity=st.integers(1, 6),
    per_layer=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_belady_hits_at_least_as_often_as_every_demand_policy(sequence, capacity, per_layer, seed):
    rng = np.random.default_rng(seed)
    scores = [dict(enumerate(rng.dirichlet(np.ones(6)).tolist())) for _ in sequence]
    frequencies = rng.random((2, 6)).tolist()
    optimum = hits(make_policy("belady", future=sequence), sequence, capacity, per_layer, scores)
    others = {
        "lru": {},
        "lfu": {},
        "fifo": {},
        "mrs": {"top_k": 1},
        "static": {"frequencies": frequencies},
    }
    for name, kwargs in others.items():
        assert optimum >= hits(make_policy(name, **kwargs), sequence, capacity, per_layer, scores), name
