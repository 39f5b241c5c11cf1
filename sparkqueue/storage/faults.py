"""Partition faults: injected ones (availability tests and drills) and damage found in storage.

A partition whose data file is missing or unreadable is marked damaged for DAMAGE_RECHECK_S: it
reports unavailable (the entity's status turns "Limited"), receives skip it (one that can read no
partition that may hold its messages raises), peeks that must read it raise, maintenance leaves it
alone and keyed sends to it fail, while the other partitions work on. After that time it is tried again, so a restored
file or a repair (`Namespace.check(repair=True)`) brings it back.
"""

from __future__ import annotations

import threading
import time

from sparkqueue.errors import PartitionUnavailableError

DAMAGE_RECHECK_S = 30.0


class FaultInjector:
    """Set of (partition, kind) pairs that raise PartitionUnavailableError, as a storage fault would."""

    def __init__(self) -> None:
        self._failing: set[tuple[int, str]] = set()
        self._damaged: dict[int, tuple[str, float]] = {}  # partition -> (what is damaged, until when)
        self._lock = threading.Lock()

    def damaged(self, partition: int, what: str) -> PartitionUnavailableError:
        """Record damage found in a partition's storage; returns the error to raise."""
        with self._lock:
            self._damaged[partition] = (what, time.monotonic() + DAMAGE_RECHECK_S)
        return PartitionUnavailableError(f"partition {partition} is unavailable: {what}")

    def _damage(self, partition: int) -> str | None:
        """What is damaged in the partition, while the mark lasts (caller holds the lock)."""
        hit = self._damaged.get(partition)
        if hit is None:
            return None
        if time.monotonic() >= hit[1]:
            del self._damaged[partition]
            return None
        return hit[0]

    def forget_damage(self) -> None:
        """Drop the damage marks (injected faults stay): they were found in another table than the one now named."""
        with self._lock:
            self._damaged.clear()

    def fail(self, partition: int, kinds: tuple[str, ...] = ("read", "write")) -> None:
        """Make the partition's reads and/or writes fail until `heal` is called."""
        with self._lock:
            self._failing.update((partition, k) for k in kinds)

    def heal(self, partition: int | None = None) -> None:
        """Clear injected faults for one partition, or for all when None."""
        with self._lock:
            self._failing = {f for f in self._failing if partition is not None and f[0] != partition}
            self._damaged = {p: d for p, d in self._damaged.items() if partition is not None and p != partition}

    def failing(self, partition: int) -> bool:
        """True when a fault is injected on the partition or damage was found in it."""
        with self._lock:
            return any(p == partition for p, _ in self._failing) or self._damage(partition) is not None

    def check(self, partition: int, kind: str) -> None:
        """Raise PartitionUnavailableError when the partition's `kind` ("read"/"write") is failing or it is damaged."""
        with self._lock:
            hit = (partition, kind) in self._failing
            damage = self._damage(partition)
        if hit:
            raise PartitionUnavailableError(f"partition {partition} is unavailable ({kind} fault)")
        if damage is not None:
            raise PartitionUnavailableError(f"partition {partition} is unavailable: {damage}")
