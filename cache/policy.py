"""The eviction-policy interface. A policy is its ordering rule (`cache.rules`, chosen by `kind`)
plus what that rule is given: MRS its α and p, static-hot the frequencies, Belady the future.

A policy object serves one cache: `attach` binds it, and a policy that knows keys in advance
(Belady's sequence, static-hot's frequencies) writes their ranks into the cache's state there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from cache.errors import PolicyError

Key = tuple[int, int]
"""(layer, expert)."""


class PolicyHost(Protocol):
    """What a policy sees of the cache it serves (`ExpertCache`): the key numbering and the state
    its ranks are written into."""

    state: Any

    def key_ids(self, keys: Sequence[Key] | np.ndarray) -> np.ndarray: ...


class EvictionPolicy:
    """Base of every policy: which rule (`kind`), and the values the rule reads."""

    kind: ClassVar[int]
    """The rule's number in `cache.state` (FIFO, LRU, ...)."""

    uses_scores: ClassVar[bool] = False
    """True if the policy needs router scores (`ExpertCache.on_step`) to make sense."""

    scores_used: int | None = None
    """How many of a step's highest scores the policy reads (None: all). A replay may keep only
    that many per step and give the same result."""

    layer_heaps: ClassVar[bool] = False
    """Whether ranks only compare within a layer (one heap per layer even under a global budget)."""

    uses_forecasts: ClassVar[bool] = False
    """True if the policy ranks keys by forecasts of their use (`ExpertCache.on_forecast`)."""

    alpha: float = 0.0
    p: int = 0
    marking: bool = False

    def __init__(self) -> None:
        self.cache: PolicyHost | None = None

    @property
    def default_rank(self) -> float:
        """The insertion rank of a key the policy was told nothing about."""
        return 0.0

    def attach(self, cache: PolicyHost) -> None:
        """Called once by the cache that owns this policy."""
        if self.cache is not None:
            raise PolicyError(
                f"this {type(self).__name__} object already serves a cache; "
                "make one policy object per cache (make_policy(name, ...))"
            )
        self.cache = cache

    def off_sequence(self, position: int, key: Key) -> PolicyError:
        """The error for a use the policy was not built for (only Belady has a sequence)."""
        return PolicyError(f"{type(self).__name__} cannot take access #{position} of {key}")
