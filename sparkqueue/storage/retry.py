"""Retry of Delta commits that lost an optimistic-concurrency race, with jittered backoff and a deadline."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sparkqueue.errors import OperationTimeoutError
from sparkqueue.storage.log import CommitConflict

log = logging.getLogger(__name__)
T = TypeVar("T")

BASE_DELAY_S = 0.002
MAX_DELAY_S = 0.25


class Deadline:
    """The point in time an operation must finish by (the client's operation_timeout)."""

    def __init__(self, timeout_s: float) -> None:
        self.expires = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.expires - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.expires


def is_conflict(exc: BaseException) -> bool:
    """True for a lost commit race: safe to retry on a fresh snapshot (a failed commit leaves nothing)."""
    return isinstance(exc, CommitConflict)


def backoff(attempt: int) -> float:
    """Full-jitter exponential backoff delay for the given attempt (0-based)."""
    return random.uniform(0, min(MAX_DELAY_S, BASE_DELAY_S * (2**attempt)))


def retry_commit(op: Callable[[], T], deadline: Deadline, what: str) -> T:
    """Run `op` until it commits, retrying commit conflicts with backoff until the deadline."""
    attempt = 0
    while True:
        try:
            return op()
        except CommitConflict as exc:
            if deadline.expired():
                raise OperationTimeoutError(
                    f"{what}: commit conflicts outlasted the operation timeout of "
                    f"{deadline.timeout_s:g}s; retry later or raise operation_timeout"
                ) from exc
            delay = min(backoff(attempt), deadline.remaining())
            log.debug("%s: commit conflict (attempt %d), retrying in %.1f ms", what, attempt, delay * 1e3)
            time.sleep(delay)
            attempt += 1
