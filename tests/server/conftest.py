"""The module-wide tiny server (see `serving`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.serving import Running, serve


@pytest.fixture(scope="module")
def tiny_server(tiny_moe_dir) -> Iterator[Running]:
    """A tiny Mixtral at a 50% expert budget, LRU, batches of up to 8."""
    with serve(tiny_moe_dir("mixtral"), policy="lru", budget=0.5, max_batch=8) as running:
        yield running
