"""Which partition a message goes to (docs/semantics.md §3): key precedence, mmh3 placement, round-robin failover."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable

import mmh3

from sparkqueue.errors import InvalidOperationError, PartitionUnavailableError


def partition_key(
    session_id: str | None, partition_key: str | None, message_id: str | None, requires_duplicate_detection: bool
) -> str | None:
    """The key that pins a message: session id, else partition key, else message id on dedupe entities."""
    if session_id is not None:
        if partition_key is not None and partition_key != session_id:
            raise InvalidOperationError(
                f"partition_key {partition_key!r} differs from session_id {session_id!r}; "
                "a session's messages are placed by the session id, so leave partition_key unset or equal"
            )
        return session_id
    if partition_key is not None:
        return partition_key
    if requires_duplicate_detection:
        return message_id
    return None


def partition_for_key(key: str, partition_count: int) -> int:
    """mmh3 (seed 0, unsigned) of the UTF-8 key modulo the partition count."""
    return mmh3.hash(key.encode("utf-8"), 0, signed=False) % partition_count


class RoundRobin:
    """Round-robin placement of unkeyed sends that skips unavailable partitions."""

    def __init__(self, partition_count: int) -> None:
        self.partition_count = partition_count
        self._counter = itertools.count(random.randrange(partition_count))
        self._lock = threading.Lock()

    def next(self, available: Callable[[int], bool]) -> int:
        """The next available partition in round-robin order; raises when none is available."""
        with self._lock:
            start = next(self._counter)
        for i in range(self.partition_count):
            p = (start + i) % self.partition_count
            if available(p):
                return p
        raise PartitionUnavailableError("no partition of the entity is available; nothing was sent")
