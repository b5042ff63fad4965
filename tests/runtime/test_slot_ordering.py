"""No two writes into a slot, and no write and an earlier read of it, overlap on the device,
whatever streams did them: shown on the CPU with a recorded stand-in for CUDA streams and events
(each stream logs what it waits for, records and writes, in enqueue order), so CI checks the
ordering without a GPU. The real streams run in the `cuda` test of test_transfer.py."""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
import torch

from offload_runtime.engine.expert_layout import ExpertSpec
from offload_runtime.engine.slots import SlotPool
from offload_runtime.engine.transfer import TransferEngine

SPEC = ExpertSpec({"w": (4, 2)}, {"w": torch.float32})


class Recorder:
    """Stand-ins for `torch.cuda.Stream`, `current_stream`, `stream` and `device`: one log of
    (stream, what, event or slot) in the order the host enqueued them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()
        self.names = itertools.count()
        self.local = threading.local()
        self.compute = self.Stream(name="compute")

    def Stream(self, device=None, name: str | None = None) -> "FakeStream":  # noqa: N802 (torch's name)
        return FakeStream(self, name or f"copy-{next(self.names)}")

    def current_stream(self, device=None) -> "FakeStream":
        return getattr(self.local, "stream", self.compute)

    @contextlib.contextmanager
    def stream(self, stream: "FakeStream"):
        before = self.current_stream()
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = before

    def note(self, stream: str, what: str, item: object) -> None:
        with self.lock:
            self.log.append((stream, what, item))

    def writes(self, slot: int) -> list[int]:
        """Positions in the log of the writes into `slot`."""
        return [i for i, (_, what, item) in enumerate(self.log) if what == "write" and item == slot]

    def ordered_after(self, first: int, second: int) -> bool:
        """Whether log entry `second` (on its stream) cannot start before entry `first` (on its)
        ends: the same stream, or `second`'s stream waited, before it, for an event that
        `first`'s stream recorded after it."""
        first_stream, second_stream = self.log[first][0], self.log[second][0]
        if first_stream == second_stream:
            return first < second
        recorded = {item for stream, what, item in self.log[first + 1:] if stream == first_stream and what == "record"}
        return any(stream == second_stream and what == "wait" and item in recorded
                   for stream, what, item in self.log[:second])


class FakeEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeStream:
    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def record_event(self) -> FakeEvent:
        event = FakeEvent()
        self.recorder.note(self.name, "record", event)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.recorder.note(self.name, "wait", event)


class GatedHostStore:
    """Host-mode experts (`resident` hands out tensors, no staging buffer); each key's copy waits
    for its gate, so the test decides which worker copies what."""

    def __init__(self) -> None:
        self.gates: dict[tuple[int, int], threading.Event] = {}
        self.starts: dict[tuple[int, int], threading.Event] = {}
        self.lock = threading.Lock()

    def gate(self, key) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(key, threading.Event())

    def started(self, key) -> threading.Event:
        with self.lock:
            return self.starts.setdefault(key, threading.Event())

    def resident(self, key):
        self.started(key).set()
        assert self.gate(key).wait(10), f"the test never opened {key}'s gate"
        return {"w": torch.full((4, 2), float(key[1]))}

    def read(self, key, out=None):
        raise AssertionError("host mode copies from resident tensors")

    def stored_nbytes(self, key) -> int:
        return 32


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    recorder = Recorder()
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(recorder, name))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return recorder


def cuda_engine(recorder: Recorder, store, workers: int) -> TransferEngine:
    """An engine that takes its pool for a CUDA one (buffers on the CPU), each write logged."""
    pool = SlotPool(SPEC, 4, num_layers=1, num_experts=8)
    pool.device = torch.device("cuda")  # only its type is read: the engine takes the CUDA path
    write = pool.write

    def logged(slot, tensors, non_blocking=False):
        recorder.note(recorder.current_stream().name, "write", slot)
        write(slot, tensors, non_blocking=non_blocking)

    pool.write = logged
    return TransferEngine(store, pool, workers=workers)


def test_a_copy_into_a_slot_waits_for_the_last_copy_on_another_stream(recorder):
    """A's copy into slot 0 is enqueued on one worker's stream; B, into the same slot, is then
    picked by the other worker: its stream must wait for A's end on the device."""
    store = GatedHostStore()
    with cuda_engine(recorder, store, workers=2) as engine:
        a = engine.request((0, 0), 0, demand=True)
        assert store.started((0, 0)).wait(5)  # a worker holds A
        c = engine.request((0, 1), 1, demand=True)
        assert store.started((0, 1)).wait(5)  # the other holds C
        b = engine.request((0, 2), 0)  # slot 0 again (A's expert evicted), a prefetch: after D
        d = engine.request((0, 3), 2, demand=True)
        store.gate((0, 0)).set()  # A's worker finishes A and takes D (a demand) ...
        assert store.started((0, 3)).wait(5)
        store.gate((0, 1)).set()  # ... so C's worker takes B, into slot 0, on its own stream
        assert store.started((0, 2)).wait(5)  # before D's worker is free to take it
        store.gate((0, 2)).set()
        store.gate((0, 3)).set()
        for ticket in (a, b, c, d):
            ticket.future.result(timeout=5)
    first, second = recorder.writes(0)
    assert recorder.log[first][0] != recorder.log[second][0]  # two streams: the case the order must cover
    assert recorder.ordered_after(first, second), recorder.log


def test_a_copy_into_a_slot_waits_for_its_last_read_on_any_stream(recorder):
    """A layer computed on slot 0 from a stream other than the requester's (`used`): the next
    copy into the slot waits for that read."""
    store = GatedHostStore()
    for key in ((0, 0), (0, 1)):
        store.gate(key).set()
    with cuda_engine(recorder, store, workers=1) as engine:
        engine.request((0, 0), 0, demand=True).future.result(timeout=5)
        reader = recorder.Stream(name="reader")
        with torch.cuda.stream(reader):
            engine.wait((0, 0))
            recorder.note("reader", "read", 0)
            engine.used([0])
        engine.request((0, 1), 0, demand=True).future.result(timeout=5)
    read = next(i for i, (_, what, _) in enumerate(recorder.log) if what == "read")
    _, second = recorder.writes(0)
    assert recorder.ordered_after(read, second), recorder.log
