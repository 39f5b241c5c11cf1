"""Per-call timeouts (the SDK's `timeout=` keyword): a bound on one call, tighter than the namespace's operation_timeout.

A context variable holds the caller's bound for the duration of the call, so entity and session
operations deep in the call take the smaller of it and the namespace's operation_timeout without
every signature carrying it; threads and other calls are not affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from sparkqueue.model import limits

_bound: ContextVar[float | None] = ContextVar("sparkqueue_call_timeout", default=None)


def check_timeout(timeout: object) -> float | None:
    """None, or a finite number of seconds greater than 0 (ValueError otherwise, as in the SDK)."""
    return None if timeout is None else limits.check_seconds(timeout, "timeout")


@contextmanager
def call_timeout(timeout: object) -> Iterator[float | None]:
    """Bound the operations inside the block by `timeout` seconds (None: the namespace's operation_timeout only)."""
    seconds = check_timeout(timeout)
    if seconds is None:
        yield None
        return
    outer = _bound.get()
    token = _bound.set(seconds if outer is None else min(outer, seconds))
    try:
        yield seconds
    finally:
        _bound.reset(token)


def effective(operation_timeout: float) -> float:
    """The timeout an operation gets now: operation_timeout, or the current call's tighter bound."""
    bound = _bound.get()
    return operation_timeout if bound is None else min(operation_timeout, bound)
