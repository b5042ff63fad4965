"""Exceptions of the cache package, each with a message that says what to do."""


class CacheError(Exception):
    """Base class of every error the cache package raises on purpose."""


class CapacityError(CacheError, ValueError):
    """A capacity is too small for the cache to serve one layer at all."""


class CacheFullError(CacheError, RuntimeError):
    """A key must be inserted but every resident key of its partition is pinned or in use."""


class UnknownPolicyError(CacheError, ValueError):
    """A policy name is not in the registry."""


class PolicyError(CacheError):
    """A policy is misused: shared by two caches, or fed accesses it was not built for."""
