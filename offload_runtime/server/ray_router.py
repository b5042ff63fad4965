"""Ray Serve's request router (alpha API in Ray 2.60) for the serving replicas: the ranking of
`routing.rank_replicas` over the replicas Ray knows, keyed by the first argument the gateway passes
(`routing.routing_key`), loaded by the requests in flight Ray's queue-length cache holds. Ray imports
it by name (`ROUTER`) when it deploys `ray_replicas`; nothing else imports this module, which needs
Ray."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from offload_runtime.server.routing import rank_replicas

ROUTER = "offload_runtime.server.ray_router:CacheAwareRouter"


class CacheAwareRouter(RequestRouter):
    """Keeps a conversation on one replica (see `routing`); `mode` and `busy_at` come from the
    deployment's `request_router_kwargs`. Not FIFO: the replica chosen for a request serves that
    request (Ray's FIFO mixin hands it to the oldest one waiting, whatever its key)."""

    def initialize_state(self, mode: str = "cache", busy_at: int = 4, seed: int | None = None, **_kwargs) -> None:
        self.mode, self.busy_at, self.rng = mode, busy_at, random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        key = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica full: back off, not spin
            key = pending_request.args[0] if pending_request.args else None
        load = {name: self.replica_queue_len_cache.get(replica.replica_id) for name, replica in by_id.items()}
        ranks = rank_replicas(key if isinstance(key, str) else None, sorted(by_id), load, self.busy_at,
                              self.mode, self.rng)
        return [[by_id[name] for name in rank] for rank in ranks]
