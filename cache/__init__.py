"""Expert caching: eviction policies, the ExpertCache, and the trace-driven simulator.

It decides which experts hold fast-memory slots; it never touches weights, and imports nothing
else of this project.
"""

from cache.errors import CacheError, CacheFullError, CapacityError, PolicyError, UnknownPolicyError
from cache.expert_cache import CacheStats, ExpertCache
from cache.policies import FIFO, LFU, LRU, MRS, POLICIES, Belady, StaticHot, make_policy, make_serving_policy
from cache.policy import EvictionPolicy, Key
from cache.simulator import Replay, SimResult, batch_rows, batch_steps, expert_frequencies, simulate

__all__ = [
    "Belady",
    "CacheError",
    "CacheFullError",
    "CacheStats",
    "CapacityError",
    "EvictionPolicy",
    "ExpertCache",
    "FIFO",
    "Key",
    "LFU",
    "LRU",
    "MRS",
    "POLICIES",
    "PolicyError",
    "Replay",
    "SimResult",
    "StaticHot",
    "UnknownPolicyError",
    "batch_rows",
    "batch_steps",
    "expert_frequencies",
    "make_policy",
    "make_serving_policy",
    "simulate",
]
