"""Fault injection: make chosen partitions of a table fail their reads or writes, for availability tests."""

from __future__ import annotations

import threading

from sparkqueue.errors import PartitionUnavailableError


class FaultInjector:
    """Set of (partition, kind) pairs that raise PartitionUnavailableError, as a storage fault would."""

    def __init__(self) -> None:
        self._failing: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def fail(self, partition: int, kinds: tuple[str, ...] = ("read", "write")) -> None:
        """Make the partition's reads and/or writes fail until `heal` is called."""
        with self._lock:
            self._failing.update((partition, k) for k in kinds)

    def heal(self, partition: int | None = None) -> None:
        """Clear injected faults for one partition, or for all when None."""
        with self._lock:
            self._failing = {f for f in self._failing if partition is not None and f[0] != partition}

    def failing(self, partition: int) -> bool:
        """True when any fault is injected on the partition."""
        with self._lock:
            return any(p == partition for p, _ in self._failing)

    def check(self, partition: int, kind: str) -> None:
        """Raise PartitionUnavailableError when the partition's `kind` ("read"/"write") is failing."""
        with self._lock:
            hit = (partition, kind) in self._failing
        if hit:
            raise PartitionUnavailableError(f"partition {partition} is unavailable ({kind} fault)")
