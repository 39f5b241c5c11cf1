"""What a Spark task needs to reach an entity: a small picklable reference, resolved once per worker process.

Tasks run in Python workers (reused between tasks), so each worker opens the namespace's broker
core once and keeps it, with its table handles and snapshots, for later tasks of any job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import wraps
from typing import TYPE_CHECKING, TypeVar

from sparkqueue.broker import Broker
from sparkqueue.errors import SparkQueueError
from sparkqueue.spark.session import task_error

if TYPE_CHECKING:
    from sparkqueue.model.entity import Entity

log = logging.getLogger(__name__)
T = TypeVar("T")

_brokers: dict[tuple[str, str, float, tuple[tuple[str, str], ...]], Broker] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class EntityRef:
    """An entity as tasks address it: namespace root, tier, timeout, storage options, entity type and catalog name."""

    root: str
    tier: str
    operation_timeout: float
    entity_type: str
    name: str
    storage_options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, broker: Broker, entity_type: str, name: str) -> EntityRef:
        """The reference of an entity of a driver-side broker (a namespace's `broker`)."""
        options = tuple(sorted(broker.storage_options.items()))
        return cls(broker.root, broker.tier, broker.operation_timeout, entity_type, name, options)

    def broker(self) -> Broker:
        """This process's broker for the root (opened on first use)."""
        key = (self.root, self.tier, self.operation_timeout, self.storage_options)
        with _lock:
            broker = _brokers.get(key)
            if broker is None:
                options = dict(self.storage_options)
                # A task works on a namespace the driver opened: one it cannot see (another machine's local root) is an
                # error, never a new empty namespace there.
                broker = Broker(
                    self.root, self.tier, operation_timeout=self.operation_timeout, storage_options=options, create=False
                )
                _brokers[key] = broker
            return broker

    def entity(self) -> Entity:
        """The entity, with settings at most a second old."""
        return self.broker().entity(self.entity_type, self.name)


# DataFrame operations commit on their own (on the driver and in tasks): they never join an open transaction.
DATAFRAME_REFUSAL = "DataFrame sends, receives and settlements cannot join a transaction"


def marking_errors(fn: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    """Wrap a task function so sparkqueue errors cross to the driver with their class (see session.spark_errors)."""

    @wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> Iterator[T]:
        try:
            yield from fn(*args, **kwargs)
        except SparkQueueError as exc:
            log.warning("task failed: %s", exc)
            raise task_error(exc) from exc

    return wrapper
