"""TransferEngine: background workers that copy experts from the store into slots.

One priority queue: demand loads first (in request order), then prefetches by predicted score,
highest first. `wait(key)` blocks a demand miss until its expert is in its slot (and upgrades a
queued prefetch of that key to a demand load). A prefetch no longer wanted is cancelled while it
waits in the queue; one already copying completes. A newer request for a slot supersedes a queued
one for another key, and never starts while an earlier copy into that slot is running.

On CUDA each worker copies on its own `torch.cuda.Stream`: from the store's pinned host memory
(host mode) or through a pinned staging buffer (disk mode). A slot is free again for the host once
its copy is *enqueued*, so the next copy into it may be picked by another worker, on another
stream, while the first still runs on the device; the ordering is therefore kept per slot, on the
device, whatever stream did what: a copy into a slot waits for an event recorded on the
requester's stream at `request` time (compute enqueued before it, which may still read the slot),
for the end of the last copy into the slot (its last write) and for the last read that `used`
recorded on any other stream; it then records an event after itself, and `wait` makes the
caller's current stream wait on that event: the host only waits for the copy to be enqueued. On
CPU the worker copies.

A worker's error is kept and raised in the caller by the next `request` or `wait`, never lost.
`close()` cancels queued work, lets running copies finish, and joins the threads.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from cache.policy import Key
from offload_runtime.engine.slots import SlotPool, TieredSlotPool
from prescient.errors import PrescientError

log = logging.getLogger(__name__)


class TransferError(PrescientError):
    """A transfer failed, timed out, or the engine is misused or closed."""


class TransferCancelledError(TransferError):
    """`wait` on a transfer that was cancelled (superseded, stale, or the engine closed)."""


class ExpertSource(Protocol):
    """What the engine needs of a store (`ExpertStore` is one)."""

    def read(self, key: Key, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]: ...

    def resident(self, key: Key) -> dict[str, torch.Tensor] | None: ...

    def stored_nbytes(self, key: Key) -> int: ...


@dataclass
class TransferStats:
    loads: int = 0  # completed copies = demand_loads + prefetch_loads
    demand_loads: int = 0  # requested as demand, or prefetches a `wait` upgraded while queued
    prefetch_loads: int = 0
    bytes_moved: int = 0
    cancelled: int = 0
    failed: int = 0
    stall_seconds: float = 0.0  # time callers spent blocked in `wait`
    copy_seconds: float = 0.0  # time the workers spent copying (on CUDA: enqueueing), over every load


@dataclass(eq=False)
class Ticket:
    """One requested copy of expert `key` into `slot`; `future` completes when it is done (on
    CUDA: enqueued; `event` then marks its end on the copy stream)."""

    key: Key
    slot: int
    demand: bool
    priority: float
    after: Any = None  # CUDA event on the requester's stream; the copy waits for it
    prior: tuple = ()  # CUDA events of the slot's last write and last read (`used`); the copy waits for them
    event: Any = None  # CUDA event recorded after the copy
    future: Future = field(default_factory=Future)
    entry: int = -1  # sequence number of its live queue entry

    def ready(self) -> bool:
        return self.future.done() and not self.future.cancelled() and self.future.exception() is None and (
            self.event is None or self.event.query())


class TransferEngine:
    """Copies from `store` into `pool`'s slots; with a tiered pool (mixed precision), `store` is
    one source per tier (`[fine, coarse]`), and a copy reads from its slot's tier's."""

    def __init__(self, store: ExpertSource | Sequence[ExpertSource], pool: SlotPool | TieredSlotPool,
                 workers: int = 1, join_timeout: float = 10.0) -> None:
        if workers < 1:  # no worker: every wait would block for ever
            raise TransferError(f"the transfer engine needs at least one worker, not {workers}")
        self.stores = list(store) if isinstance(store, Sequence) else [store]
        self.pool = pool
        self.join_timeout = join_timeout
        self._cuda = pool.device.type == "cuda"
        self._cond = threading.Condition()
        self._queue: list[tuple[int, float, int, Ticket]] = []
        self._seq = itertools.count()
        self._tickets: dict[Key, Ticket] = {}
        self._queued_in: dict[int, Ticket] = {}  # slot → its newest queued ticket
        self._busy: set[int] = set()  # slots being copied into
        self._last_write: dict[int, Any] = {}  # CUDA: slot → event at the end of its last copy
        self._last_read: dict[int, Any] = {}  # CUDA: slot → event after its last read (`used`)
        self._deferred: list[Ticket] = []  # popped while their slot was busy
        self._failed: list[Ticket] = []  # failures not yet raised in a caller
        self._pending = 0  # tickets requested, neither finished nor cancelled
        self._stats = TransferStats()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"expert-transfer-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    # -- caller side -------------------------------------------------------------------------

    def request(self, key: Key, slot: int, priority: float = 0.0, demand: bool = False) -> Ticket:
        """Queue a copy of `key` into `slot`. A key already queued or copying into the same
        slot returns its ticket (raised to demand or to the higher priority)."""
        after = torch.cuda.current_stream(self.pool.device).record_event() if self._cuda else None
        with self._cond:
            self._raise_failure()
            if self._closed:
                raise TransferError(f"cannot load expert {key}: the transfer engine is closed")
            old = self._tickets.get(key)
            if old is not None and not old.future.done():
                if old.slot != slot:
                    raise TransferError(f"expert {key} is already loading into slot {old.slot}; cancel it "
                                        f"before asking for slot {slot}")
                if not old.future.running() and (demand > old.demand or priority > old.priority):
                    old.demand, old.priority = old.demand or demand, max(priority, old.priority)
                    self._push(old)
                return old
            stale = self._queued_in.get(slot)
            if stale is not None:
                self._cancel(stale)
            ticket = Ticket(key, slot, demand, priority, after=after)
            self._tickets[key] = self._queued_in[slot] = ticket
            self._pending += 1
            self._push(ticket)
            return ticket

    def wait(self, key: Key, timeout: float | None = None) -> None:
        """Block until `key`'s requested copy is done; on CUDA, make the current stream wait for
        it. Raises TransferError if it failed, TransferCancelledError if it was cancelled."""
        start = time.perf_counter()
        with self._cond:
            self._raise_failure()
            ticket = self._wanted_now(key)
        try:
            ticket.future.result(timeout)
        except CancelledError:
            raise TransferCancelledError(f"the load of expert {key} into slot {ticket.slot} was cancelled") from None
        except TimeoutError:
            raise TransferError(f"expert {key} was not loaded within {timeout} s") from None
        except Exception as exc:
            with self._cond:
                if ticket in self._failed:
                    self._failed.remove(ticket)
            raise TransferError(f"loading expert {key} into slot {ticket.slot} failed: {exc}") from exc
        finally:
            with self._cond:
                self._stats.stall_seconds += time.perf_counter() - start
        if ticket.event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ticket.event)

    def wait_any(self, keys: Sequence[Key]) -> list[Key]:
        """Block until at least one of `keys`' requested copies is done (each of them still queued
        as a prefetch is raised to a demand load first); return the keys whose copies are done.
        `wait` on each of them then raises a failed or cancelled copy (and orders CUDA streams)."""
        start = time.perf_counter()
        with self._cond:
            self._raise_failure()
            waiting = {self._wanted_now(key).future: key for key in keys}
        try:
            done = futures.wait(list(waiting), return_when=futures.FIRST_COMPLETED).done
        finally:
            with self._cond:
                self._stats.stall_seconds += time.perf_counter() - start
        return [waiting[future] for future in done]

    def used(self, slots: Iterable[int]) -> None:
        """CUDA: the current stream has enqueued its reads of `slots` (a layer computed on them);
        the next copy into each waits for them, whatever stream it runs on. No-op on the CPU."""
        if not self._cuda:
            return
        event = torch.cuda.current_stream(self.pool.device).record_event()
        with self._cond:
            for slot in slots:
                self._last_read[slot] = event

    def ready(self, key: Key) -> bool:
        """Whether `key`'s last requested copy has finished, without blocking."""
        with self._cond:
            ticket = self._tickets.get(key)
        return ticket is not None and ticket.ready()

    def cancel(self, key: Key) -> bool:
        """Drop `key`'s queued copy; False if there is none (never requested, running, done)."""
        with self._cond:
            ticket = self._tickets.get(key)
            return ticket is not None and self._cancel(ticket)

    def cancel_stale(self, keep: Iterable[Key]) -> list[Key]:
        """Drop every queued prefetch whose key is not in `keep`; return the dropped keys."""
        keep = set(keep)
        with self._cond:
            stale = [t for key, t in self._tickets.items() if key not in keep and not t.demand]
            return [t.key for t in stale if self._cancel(t)]

    @property
    def stats(self) -> TransferStats:
        with self._cond:
            return replace(self._stats)

    @property
    def queued(self) -> int:
        """Copies waiting to start."""
        with self._cond:
            return sum(not t.future.done() and not t.future.running() for t in self._tickets.values())

    @property
    def pending(self) -> int:
        """Copies waiting or running (a counter: the runtime reads it on the decode path)."""
        with self._cond:
            return self._pending

    def close(self) -> None:
        """Cancel queued copies, let running ones finish, stop the workers. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for ticket in list(self._tickets.values()):
                self._cancel(ticket)
            self._queue.clear()
            self._deferred.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(self.join_timeout)
            if thread.is_alive():
                log.warning("%s still copying after %.0f s; leaving it (daemon thread)", thread.name, self.join_timeout)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (lock held unless said) -----------------------------------------------------

    def _wanted_now(self, key: Key) -> Ticket:
        """`key`'s ticket, a queued prefetch raised to a demand load (the caller holds the lock)."""
        ticket = self._tickets.get(key)
        if ticket is None:
            raise TransferError(f"expert {key} was never requested; call request() first")
        if not ticket.demand and not ticket.future.done() and not ticket.future.running():
            ticket.demand = True
            self._push(ticket)
        return ticket

    def _push(self, ticket: Ticket) -> None:
        ticket.entry = next(self._seq)
        rank = (0, 0.0) if ticket.demand else (1, -ticket.priority)
        heapq.heappush(self._queue, (*rank, ticket.entry, ticket))
        self._cond.notify()

    def _cancel(self, ticket: Ticket) -> bool:
        if ticket.future.cancelled() or not ticket.future.cancel():
            return False
        self._stats.cancelled += 1
        self._pending -= 1
        if self._queued_in.get(ticket.slot) is ticket:
            del self._queued_in[ticket.slot]
        return True

    def _raise_failure(self) -> None:
        if self._failed:
            ticket = self._failed.pop(0)
            exc = ticket.future.exception()
            raise TransferError(f"loading expert {ticket.key} into slot {ticket.slot} failed: {exc}") from exc

    def _next(self) -> Ticket | None:
        """The next ticket to copy, marked running; None once the engine is closed."""
        while not self._closed:
            while self._queue:
                *_, entry, ticket = heapq.heappop(self._queue)
                if entry != ticket.entry or ticket.future.done():
                    continue  # superseded entry, or cancelled
                if ticket.slot in self._busy:
                    self._deferred.append(ticket)
                    continue
                if not ticket.future.set_running_or_notify_cancel():
                    continue
                self._busy.add(ticket.slot)
                ticket.prior = tuple(e for e in (self._last_write.get(ticket.slot), self._last_read.get(ticket.slot))
                                     if e is not None)
                if self._queued_in.get(ticket.slot) is ticket:
                    del self._queued_in[ticket.slot]
                return ticket
            self._cond.wait()
        return None

    def _finish(self, ticket: Ticket, error: Exception | None) -> None:
        self._busy.discard(ticket.slot)
        if ticket.event is not None:  # CUDA: enqueued, maybe still running; the next writer waits for it
            self._last_write[ticket.slot] = ticket.event
        self._pending -= 1
        for waiting in [t for t in self._deferred if t.slot == ticket.slot]:
            self._deferred.remove(waiting)
            self._push(waiting)
        stats = self._stats
        if error is not None:
            stats.failed += 1
            self._failed.append(ticket)
            ticket.future.set_exception(error)
            return
        stats.loads += 1
        stats.demand_loads += ticket.demand
        stats.prefetch_loads += not ticket.demand
        stats.bytes_moved += self._source(ticket).stored_nbytes(ticket.key)
        ticket.future.set_result(None)

    def _run(self) -> None:
        """Worker thread (takes the lock only to pick and to finish)."""
        copy = self._cuda_copier() if self._cuda else self._cpu_copy
        while True:
            with self._cond:
                ticket = self._next()
            if ticket is None:
                return
            start = time.perf_counter()
            try:
                copy(ticket)
                error = None
            except Exception as exc:  # kept for the caller: raised by the next request/wait
                log.debug("loading expert %s failed", ticket.key, exc_info=True)
                error = exc
            with self._cond:
                self._stats.copy_seconds += time.perf_counter() - start
                self._finish(ticket, error)

    def _source(self, ticket: Ticket) -> ExpertSource:
        return self.stores[self.pool.map.tier_of(ticket.slot)]

    def _cpu_copy(self, ticket: Ticket) -> None:
        self._source(ticket).read(ticket.key, out=self.pool.view(ticket.slot))

    def _cuda_copier(self) -> Callable[[Ticket], None]:
        """A copy function with this worker's stream and pinned staging buffer."""
        device = self.pool.device
        stream = torch.cuda.Stream(device)
        staging: dict[str, torch.Tensor] = {}
        staged: list[torch.cuda.Event] = []  # end of the last copy out of `staging`

        def copy(ticket: Ticket) -> None:
            source = self._source(ticket).resident(ticket.key)
            from_disk = source is None
            if from_disk:  # read into the pinned buffer once the last copy out of it is done
                if not staging:
                    staging.update({name: t[0] for name, t in self.pool.spec.empty(1, pin=True).items()})
                if staged:
                    staged.pop().synchronize()
                source = self._source(ticket).read(ticket.key, out=staging)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for event in (ticket.after, *ticket.prior):  # see the module doc: no two writes, no read, overlap
                    if event is not None:
                        stream.wait_event(event)
                self.pool.write(ticket.slot, source, non_blocking=True)
                ticket.event = stream.record_event()
            if from_disk:
                staged.append(ticket.event)

        return copy
