"""Cache-aware routing between replicas, without Ray: the key of a request (a conversation's turns
share one), the replica a key belongs to (stable, balanced, moving only what a lost replica held),
the fallback to the least loaded when that replica is busy, the random baseline; the merge of the
replicas' /metrics; the one-line error without the extra."""

from __future__ import annotations

import json
import random
import sys

import pytest

from offload_runtime.server.metrics import ServerMetrics, merge_expositions
from offload_runtime.server.routing import SESSION_HEADER, preferred_replica, rank_replicas, routing_key
from prescient.errors import ServerSettingsError

SYSTEM = {"role": "system", "content": "You answer questions about Python."}


def chat(*messages: dict) -> bytes:
    return json.dumps({"model": "tiny", "messages": list(messages)}).encode()


def test_the_turns_of_a_conversation_share_a_key_and_conversations_differ():
    first = {"role": "user", "content": "What does os.path.join do?"}
    turn1 = routing_key({}, chat(SYSTEM, first))
    turn2 = routing_key({}, chat(SYSTEM, first, {"role": "assistant", "content": "It joins."},
                              {"role": "user", "content": "And on Windows?"}))
    other = routing_key({}, chat(SYSTEM, {"role": "user", "content": "What is a generator?"}))
    assert turn1 == turn2 and turn1 != other and turn1 is not None


def test_a_completion_is_keyed_by_the_start_of_its_prompt():
    start = "def read(path):\n" * 40  # longer than the prefix that keys it
    assert routing_key({}, json.dumps({"prompt": start}).encode()) == \
        routing_key({}, json.dumps({"prompt": start + "    return open(path).read()"}).encode())
    assert routing_key({}, json.dumps({"prompt": [[1, 2, 3]]}).encode()) == \
        routing_key({}, json.dumps({"prompt": [1, 2, 3]}).encode())


def test_the_session_header_wins_and_a_request_without_a_prompt_has_no_key():
    assert routing_key({SESSION_HEADER: "abc"}, chat(SYSTEM)) == "session:abc"
    assert routing_key({}, b"") is None
    assert routing_key({}, b"not json") is None
    assert routing_key({}, b"[1, 2]") is None


def test_keys_spread_over_replicas_and_a_lost_replica_moves_only_its_keys():
    replicas = ["r1", "r2", "r3"]
    keys = [f"prefix:conversation {n}" for n in range(600)]
    owners = {key: preferred_replica(key, replicas) for key in keys}
    counts = [list(owners.values()).count(r) for r in replicas]
    assert all(150 <= c <= 250 for c in counts), counts
    after = {key: preferred_replica(key, ["r1", "r3"]) for key in keys}
    assert all(after[key] == owners[key] for key in keys if owners[key] != "r2")
    assert preferred_replica(keys[0], list(reversed(replicas))) == owners[keys[0]]  # order does not matter


def test_the_key_replica_first_unless_it_is_busy_then_the_least_loaded():
    replicas = ["r1", "r2"]
    key = "prefix:hello"
    mine = preferred_replica(key, replicas)
    assert rank_replicas(key, replicas, {"r1": 1, "r2": 0}, busy_at=4) == [[mine], replicas]
    assert rank_replicas(key, replicas, {}, busy_at=4) == [[mine], replicas]  # unknown load: idle
    assert rank_replicas(key, replicas, {mine: 4}, busy_at=4) == [replicas]  # busy: Ray takes the least loaded
    assert rank_replicas(None, replicas, {}, busy_at=4) == [replicas]
    assert rank_replicas(key, replicas, {}, busy_at=4, mode="least-loaded") == [replicas]
    assert rank_replicas(key, [], {}, busy_at=4) == []


def test_random_routing_ignores_the_key():
    rng = random.Random(0)
    firsts = {rank_replicas("prefix:same", ["r1", "r2"], {}, 4, "random", rng)[0][0] for _ in range(40)}
    assert firsts == {"r1", "r2"}
    with pytest.raises(ValueError, match="unknown routing mode"):
        rank_replicas("k", ["r1"], {}, 4, mode="sticky")


def test_the_replicas_metrics_merge_into_one_exposition_labelled_by_replica():
    texts = [ServerMetrics({"policy": "lru", "budget": "0.5", "predictor": "none", "replica": name}).render().decode()
             for name in ("a", "b")]
    merged = merge_expositions(texts).decode()
    assert merged.count("# HELP prescient_ready ") == 1
    assert 'prescient_ready{budget="0.5",policy="lru",predictor="none",replica="a"} 0.0' in merged
    assert 'replica="b"' in merged


def test_replicas_without_ray_is_one_line_saying_what_to_install(monkeypatch):
    from offload_runtime.server.ray_replicas import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ServerSettingsError, match=r'pip install -e "\.\[ray\]"'):
        require_ray()
