"""What one daemon serves on one device: its caches, by fingerprint, within a byte budget.

A daemon started with a model holds one cache it loaded itself. A store daemon (no
model) starts empty and holds every cache engines publish into it (docs/protocol.md,
"Publishing"). Either way an attach finds its cache here by the expected fingerprint.

A publication goes through three states: *reserved* (slabs allocated, the writer
filling them, invisible to readers), then *committed* (sealed, served), or *dropped*
(the writer died, timed out or failed; its slabs are freed). Bytes reserved count
against the budget like bytes committed, so two writers can never overfill a device.
Caches nobody is attached to may be evicted, least recently used first, to make room.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

from weightcache.client import fingerprint as fp

log = logging.getLogger("weightcache.daemon")


class OverBudget(Exception):
    """The planned slabs do not fit the bytes per device this daemon may allocate."""


@dataclass
class Entry:
    """One committed cache: what engines attach to, and the slabs behind it."""

    cache: "object"  # server.ResidentCache
    slabs: list = field(default_factory=list)  # backend slabs this daemon owns (freed on eviction)
    publisher_uid: int | None = None  # None: loaded by the daemon itself
    attached: int = 0
    committed_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def digest(self) -> str:
        return fp.digest(self.cache.fingerprint)


@dataclass
class Reservation:
    """Bytes held for one publication between Writable and commit."""

    digest: str
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)


class Catalog:
    def __init__(self, budget_bytes: int | None = None, *, store: bool = False):
        self.budget_bytes = budget_bytes
        self.store = store
        self._entries: dict[str, Entry] = {}
        self._reserved: dict[str, Reservation] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    # -- readers ---------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def find(self, expected) -> tuple[Entry | None, list[tuple[str, str, str]]]:
        """The entry serving exactly this fingerprint, or (None, the differences from the
        closest one; empty if the catalog holds nothing)."""
        wanted = fp.digest(expected)
        with self._lock:
            entry = self._entries.get(wanted)
            if entry is not None:
                return entry, []
            candidates = list(self._entries.values())
        if not candidates:
            return None, []
        nearest = min(candidates, key=lambda e: (len(fp.differences(expected, e.cache.fingerprint)), -e.last_used))
        return None, fp.differences(expected, nearest.cache.fingerprint)

    def attach(self, entry: Entry) -> bool:
        """Count an engine on ENTRY; False if it was evicted meanwhile."""
        with self._lock:
            if self._entries.get(entry.digest) is not entry:
                return False
            entry.attached += 1
            entry.last_used = time.monotonic()
            return True

    def detach(self, entry: Entry) -> None:
        with self._lock:
            entry.attached -= 1
            entry.last_used = time.monotonic()

    @property
    def attached_clients(self) -> int:
        with self._lock:
            return sum(e.attached for e in self._entries.values())

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return sum(e.cache.resident_bytes for e in self._entries.values()) + \
            sum(r.nbytes for r in self._reserved.values())

    # -- the loaded cache ------------------------------------------------------------
    def add_loaded(self, cache, slabs=()) -> Entry:
        entry = Entry(cache, list(slabs))
        with self._lock:
            self._entries[entry.digest] = entry
        return entry

    # -- publications ----------------------------------------------------------------
    def reserve(self, digest: str, nbytes: int, wait_s: float):
        """Hold NBYTES for a publication of DIGEST. Returns the committed Entry when it is
        (or, waiting up to WAIT_S for another writer of it, becomes) published, else a
        Reservation this caller now fills. Raises OverBudget naming what holds the bytes,
        TimeoutError if the other writer neither commits nor drops within WAIT_S."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                entry = self._entries.get(digest)
                if entry is not None:
                    return entry
                other = self._reserved.get(digest)
                if other is None:
                    evicted = self._make_room(nbytes)
                    reservation = Reservation(digest, nbytes)
                    self._reserved[digest] = reservation
                    break
            # Another writer publishes these very tensors: wait for its commit or drop.
            if not other.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"another writer has been publishing fingerprint {digest[:12]} for longer than "
                                   f"{wait_s:.0f}s")
        for victim in evicted:
            log.info("evicted", extra={"fields": {"fingerprint": victim.digest[:12],
                                                  "bytes": victim.cache.resident_bytes, "why": "room for a publication"}})
            close_slabs(victim.slabs)
        return reservation

    def _make_room(self, nbytes: int) -> list[Entry]:
        """Under the lock: evict idle caches (least recently used first) until NBYTES fit."""
        if self.budget_bytes is None or self._used() + nbytes <= self.budget_bytes:
            return []
        idle = sorted((e for e in self._entries.values() if e.attached == 0), key=lambda e: e.last_used)
        freeable = sum(e.cache.resident_bytes for e in idle)
        if self._used() - freeable + nbytes > self.budget_bytes:
            held = self._used() - freeable
            raise OverBudget(f"the publication needs {nbytes} bytes, but this device's budget is {self.budget_bytes} "
                             f"bytes and {held} of them are held by caches engines are attached to or publications "
                             "in progress (--max-device-bytes)")
        victims = []
        for entry in idle:
            if self._used() + nbytes <= self.budget_bytes:
                break
            del self._entries[entry.digest]
            victims.append(entry)
            self.evictions += 1
        return victims

    def commit(self, reservation: Reservation, entry: Entry) -> None:
        with self._lock:
            self._reserved.pop(reservation.digest, None)
            self._entries[entry.digest] = entry
        reservation.done.set()

    def drop(self, reservation: Reservation) -> None:
        with self._lock:
            if self._reserved.get(reservation.digest) is reservation:
                del self._reserved[reservation.digest]
        reservation.done.set()

    def close(self) -> None:
        """Free every slab this daemon owns (engines that mapped them keep theirs)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            close_slabs(entry.slabs)


def close_slabs(slabs) -> None:
    for slab in slabs:
        try:
            slab.close()
        except OSError as exc:
            log.warning("could not free a slab", extra={"fields": {"error": str(exc)}})
