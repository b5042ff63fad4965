"""Exceptions of the cache package, each with a message that says what to do."""

from prescient.errors import CapacityError, PrescientError

__all__ = ["CacheError", "CacheFullError", "CapacityError", "PolicyError", "ReplayInputError", "UnknownPolicyError"]


class CacheError(PrescientError):
    """Base class of every error the cache package raises on purpose."""


class CacheFullError(CacheError, RuntimeError):
    """A key must be inserted but every resident key of its partition is pinned or in use."""


class UnknownPolicyError(CacheError, ValueError):
    """A policy name is not in the registry."""


class PolicyError(CacheError):
    """A policy is misused: shared by two caches, fed accesses it was not built for, or asked to
    serve when it needs what only a trace knows."""


class ReplayInputError(CacheError, ValueError):
    """A trace's arrays cannot be replayed: expert ids out of range, scores that are not finite,
    or shapes that disagree."""
