"""Cache-aware routing between serving replicas, as pure functions (no Ray here; `ray_router` and
`ray_replicas` put them on Ray Serve).

Each replica has its own expert cache. A conversation's next turn resends the turns before it, and
the experts those tokens route to are the ones its last request left resident, on the replica that
served it. So a request is keyed (`routing_key`) by its session (an `X-Session-ID` header) or else by
the start of its prompt (a chat's messages up to its first user message, a completion's first
characters), and the key picks one replica by rendezvous hashing (`preferred_replica`: the replica
with the highest hash of (replica, key); when a replica joins or leaves, only the keys it wins or
held move). When the preferred replica is busy (`busy_at` requests in flight or more) the request
goes to the least loaded replica instead (`rank_replicas`).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence

SESSION_HEADER = "x-session-id"
PREFIX_CHARS = 256  # the start of a prompt that keys it: a conversation's first turn, not its later ones
MODES = ("cache", "random", "least-loaded")


def routing_key(headers: Mapping[str, str], body: bytes, prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The key that keeps a request with its conversation: the session header if sent (header names
    in lower case), else a prefix of the prompt; None for a request without one (GET routes, a body
    that is not a JSON completion or chat)."""
    session = headers.get(SESSION_HEADER)
    if session:
        return f"session:{session}"
    try:
        request = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    prefix = _prompt_prefix(request)
    return None if not prefix else f"prefix:{prefix[:prefix_chars]}"


def _prompt_prefix(request: dict) -> str | None:
    """A chat's messages up to and including its first user message (what every later turn
    resends unchanged), or a completion's prompt (text, or token ids as text)."""
    messages = request.get("messages")
    if isinstance(messages, list):
        head = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            head.append(f"{message.get('role')}: {json.dumps(message.get('content'), sort_keys=True)}")
            if message.get("role") == "user":
                break
        return "\n".join(head)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):
        prompt = " ".join(str(token) for token in prompt)
    return prompt if isinstance(prompt, str) else None


def _score(replica: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest(), "big")


def preferred_replica(key: str, replicas: Sequence[str]) -> str:
    """The replica `key` belongs to: the highest rendezvous score (stable across processes and runs)."""
    if not replicas:
        raise ValueError("no replicas to route to")
    return max(replicas, key=lambda replica: _score(replica, key))


def rank_replicas(key: str | None, replicas: Sequence[str], load: Mapping[str, int | None], busy_at: int,
                  mode: str = "cache", rng: random.Random | None = None) -> list[list[str]]:
    """The replicas to try, as Ray Serve's request router takes them: ranks, most preferred first;
    within a rank the least loaded that has room is taken. `load` is each replica's requests in
    flight (None: not known, taken as idle). `mode` "cache": the key's replica while it has fewer
    than `busy_at` in flight, else (or without a key) the least loaded; "random": one replica at
    random (the baseline); "least-loaded": the least loaded, keys ignored."""
    if mode not in MODES:
        raise ValueError(f"unknown routing mode {mode!r}; one of {', '.join(MODES)}")
    everyone = [list(replicas)] if replicas else []
    if not replicas or mode == "least-loaded":
        return everyone
    if mode == "random":
        return [[(rng or random).choice(list(replicas))], *everyone]
    if key is None:
        return everyone
    chosen = preferred_replica(key, replicas)
    if (load.get(chosen) or 0) >= busy_at:
        return everyone
    return [[chosen], *everyone]
