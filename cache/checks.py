"""What `ExpertCache`'s public methods check before the compiled kernels run: the kernels index
their arrays without bounds checks (numba), so a key, an id or an offset out of range would
read or write outside them. Each check raises `CacheError` saying what is wrong."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from cache.errors import CacheError

MAX_LAYERS = 1 << 16  # bounds for a cache built without n_layers / n_experts
MAX_EXPERTS = 1 << 31  # a key's order packs the expert into 32 bits


def key_pairs(keys: Iterable, n_layers: int | None, n_experts: int | None) -> np.ndarray:
    """`keys` as an [M, 2] int64 array of (layer, expert); each must be a pair of whole numbers
    with 0 <= layer < n_layers and 0 <= expert < n_experts (bounded above either way)."""
    pairs = list(keys) if not isinstance(keys, np.ndarray) else keys.reshape(-1, 2).tolist()
    for key in pairs:
        if not (isinstance(key, (tuple, list)) and len(key) == 2 and all(_whole(part) for part in key)):
            raise CacheError(f"key {key!r} is not a (layer, expert) pair of whole numbers")
    array = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    for column, (name, limit) in enumerate((("layer", n_layers or MAX_LAYERS), ("expert", n_experts or MAX_EXPERTS))):
        outside = (array[:, column] < 0) | (array[:, column] >= limit)
        if outside.any():
            key = tuple(array[np.flatnonzero(outside)[0]].tolist())
            raise CacheError(f"key {key} names {name} {key[column]}, outside 0..{limit - 1}")
    return array


def _whole(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def scores(values: np.ndarray) -> np.ndarray:
    """Router scores: finite numbers (a NaN would silently reorder MRS's heap)."""
    if not np.isfinite(values).all():
        raise CacheError(f"router scores must be finite numbers, got {values[~np.isfinite(values)][0]}")
    return values


def replay_arrays(n_layers: int, max_layers: int, n_keys: int, keys: np.ndarray, offsets: np.ndarray,
                  score_arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                  predicted: tuple[np.ndarray, np.ndarray] | None, ahead: int,
                  forecasts: tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray] | None = None) -> None:
    """A replay's arrays (see `ExpertCache.replay`): key ids below `n_keys` (the numbered keys),
    offsets that start at 0 or later, never decrease and stay within their keys, as many offsets
    in each array (forecasts: any number of token-steps), finite scores, chances in [0, 1],
    `n_layers` within the cache's `max_layers`, and 0 <= ahead <= n_layers."""
    if not _whole(n_layers) or not 1 <= n_layers <= max_layers:
        raise CacheError(f"n_layers {n_layers!r} must be in 1..{max_layers} (the cache's layers)")
    _ids("keys", keys, n_keys)
    _offsets("offsets", offsets, len(keys), len(offsets))
    if (len(offsets) - 1) % n_layers:
        raise CacheError(f"offsets describe {len(offsets) - 1} layer-steps, not whole token-steps of {n_layers} layers")
    if score_arrays is not None:
        _keyed_values("score", score_arrays, n_keys, len(offsets), scores)
    if predicted is not None:
        predicted_keys("predicted", predicted, n_keys, len(offsets))
    if not _whole(ahead) or not 0 <= ahead <= n_layers:
        raise CacheError(f"ahead {ahead!r} must be in 0..{n_layers} layers")
    if forecasts is not None:  # any number of token-steps
        keys, soon, later, steps = forecasts
        _keyed_values("forecast", (keys, soon, steps), n_keys, max(len(steps), 1), chances)
        if later is not None:
            _keyed_values("later forecast", (keys, later, steps), n_keys, max(len(steps), 1), chances)


def predicted_keys(name: str, predicted: tuple[np.ndarray, np.ndarray], n_keys: int, n_offsets: int) -> None:
    """Predicted key ids below `n_keys`, with `n_offsets` offsets over them (one per layer-step + 1)."""
    _ids(f"{name} keys", predicted[0], n_keys)
    _offsets(f"{name} offsets", predicted[1], len(predicted[0]), n_offsets)


def _keyed_values(name: str, arrays: tuple[np.ndarray, np.ndarray, np.ndarray], n_keys: int, n_offsets: int,
                  check_values) -> None:
    """Key ids in range, one value per key (each passing `check_values`), offsets over them."""
    keys, values, offsets = arrays
    _ids(f"{name} keys", keys, n_keys)
    if len(values) != len(keys):
        raise CacheError(f"{len(values)} {name} values for {len(keys)} {name} keys")
    check_values(np.asarray(values, dtype=np.float64))
    _offsets(f"{name} offsets", offsets, len(keys), n_offsets)


def chances(values: np.ndarray) -> np.ndarray:
    """Forecast chances of use: each in [0, 1] (learned eviction adds a mark of 1 above them)."""
    if not (np.isfinite(values) & (values >= 0) & (values <= 1)).all():
        raise CacheError("forecast chances must lie in [0, 1]")
    return values


def _ids(name: str, ids: np.ndarray, n_keys: int) -> None:
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise CacheError(f"{name} must be a 1-D integer array of key ids (from `key_ids`)")
    if len(ids) and (ids.min() < 0 or ids.max() >= n_keys):
        bad = ids[(ids < 0) | (ids >= n_keys)][0]
        raise CacheError(f"{name} hold key id {bad}, outside 0..{n_keys - 1} (the keys numbered by `key_ids`)")


def _offsets(name: str, offsets: np.ndarray, n_items: int, expected: int) -> None:
    if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise CacheError(f"{name} must be a 1-D integer array")
    if len(offsets) != expected or not len(offsets):
        raise CacheError(f"{name} hold {len(offsets)} entries, expected {max(expected, 1)}")
    if offsets[0] < 0 or offsets[-1] > n_items or (np.diff(offsets) < 0).any():
        raise CacheError(f"{name} must rise from 0 or more to at most {n_items} (the entries they index)")


def durations(**seconds: float) -> None:
    """Simulated durations: finite and not negative."""
    for name, value in seconds.items():
        if not np.isfinite(value) or value < 0:
            raise CacheError(f"{name} {value!r} must be a finite number of seconds, 0 or more")
