"""The namespace: client and administration client in one (SDK: ServiceBusClient + ServiceBusAdministrationClient)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TypeVar

from sparkqueue.broker import Broker, Transaction, sub_entity_name
from sparkqueue.constants import ReceiveMode, SubQueue
from sparkqueue.management import Management
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, SUBSCRIPTION, TOPIC
from sparkqueue.model.sessions import SessionInfo, Sessions
from sparkqueue.receiver import Receiver
from sparkqueue.sender import Sender
from sparkqueue.storage.faults import FaultInjector

log = logging.getLogger(__name__)

_H = TypeVar("_H", Sender, Receiver)


class Namespace(Management):
    """A root location holding a catalog and one Delta table per queue or topic; opened (and created) by path or URI."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        tier: str | None = None,
        *,
        operation_timeout: float = 60.0,
        storage_options: Mapping[str, str] | None = None,
        create: bool = True,
    ) -> None:
        """Open the namespace at `root`, creating it when absent (with `create=False`: EntityNotFoundError instead).

        `tier` is "standard" or "premium"; a new namespace records it ("standard" when None) and keeps
        it: an existing one opens with its own tier, and naming another raises InvalidOperationError.
        Readers and tools that must not create a namespace at a mistyped root pass `create=False`.
        """
        broker = Broker(root, tier, operation_timeout=operation_timeout, storage_options=storage_options, create=create)
        super().__init__(broker)
        self.root = self.broker.root
        self.tier = self.broker.tier
        self.operation_timeout = self.broker.operation_timeout
        self.storage_options = self.broker.storage_options
        self.store = self.broker.store
        self._handlers: weakref.WeakSet[Sender | Receiver] = weakref.WeakSet()  # open ones, closed with the namespace
        self._handlers_lock = threading.Lock()

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every sender and receiver it gave out, then drop cached handles; it may be entered again afterwards.

        As the SDK's client does: a receiver's close releases its prefetched messages and its
        session lock at once, instead of leaving them locked until the lock expires.
        """
        with self._handlers_lock:
            handlers = list(self._handlers)
        for handler in handlers:
            try:
                handler.close()
            except Exception as exc:  # one handler's storage error never keeps the others (or the namespace) open
                log.warning("closing %r failed (a later close tries again): %s", handler, exc)
            else:
                with self._handlers_lock:
                    self._handlers.discard(handler)
        self.broker.close()

    def _track(self, handler: _H) -> _H:
        """Remember a handler so that closing the namespace closes it."""
        with self._handlers_lock:
            self._handlers.add(handler)
        return handler

    def __repr__(self) -> str:
        return f"Namespace({self.root!r}, tier={self.tier!r})"

    def __reduce__(self) -> tuple[Any, tuple[str, str, float, dict[str, str]]]:
        """Pickled as its location and options, so a Spark closure can capture it: each worker opens its own handle."""
        return _reopen, (self.root, self.tier, self.operation_timeout, dict(self.storage_options))

    # ---- the broker core (sparkqueue/broker.py) -------------------------------------------------

    def fault_injector(self, entity_name: str, entity_type: str = QUEUE) -> FaultInjector:
        """This process's fault hook on a queue's or topic's table (a topic's covers its subscriptions)."""
        return self.broker.fault_injector(entity_name, entity_type)

    def table_uri(self, table_path: str) -> str:
        """Where a catalog table path lives: paths are recorded relative to the root (so a copied namespace is its own)."""
        return self.broker.table_uri(table_path)

    def forward_pending_messages(self) -> None:
        """Finish every pending auto-forward in the namespace (after a crash, or when forward_to was set later)."""
        self.broker.forward_pending_messages()

    # ---- senders and receivers -----------------------------------------------------------------

    def get_queue_sender(self, queue_name: str) -> Sender:
        """A sender to the queue."""
        return self._track(Sender(self, QUEUE, queue_name))

    def get_topic_sender(self, topic_name: str) -> Sender:
        """A sender to the topic: each message is copied to every subscription whose rules match."""
        return self._track(Sender(self, TOPIC, topic_name))

    def get_queue_receiver(
        self,
        queue_name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        session_id: Any = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
        auto_lock_renewer: Any = None,
    ) -> Receiver:
        """A receiver of the queue, of its dead-letter sub-queue, or (session_id) of one of its sessions."""
        return self._track(
            Receiver(
                self,
                QUEUE,
                limits.check_name_type(queue_name),
                receive_mode=receive_mode,
                sub_queue=sub_queue,
                prefetch_count=prefetch_count,
                max_wait_time=max_wait_time,
                session_id=session_id,
                auto_lock_renewer=auto_lock_renewer,
            )
        )

    def get_subscription_receiver(
        self,
        topic_name: str,
        subscription_name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        session_id: Any = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
        auto_lock_renewer: Any = None,
    ) -> Receiver:
        """A receiver of a subscription, of its dead-letter sub-queue, or of one of its sessions."""
        return self._track(
            Receiver(
                self,
                SUBSCRIPTION,
                sub_entity_name(topic_name, subscription_name),
                receive_mode=receive_mode,
                sub_queue=sub_queue,
                prefetch_count=prefetch_count,
                max_wait_time=max_wait_time,
                session_id=session_id,
                auto_lock_renewer=auto_lock_renewer,
            )
        )

    # ---- transactions and sessions ------------------------------------------------------------

    def transaction(self) -> Transaction:
        """`with ns.transaction() as tx:` groups sends and settlements on one entity into one atomic commit."""
        return self.broker.transaction()

    def list_queue_sessions(self, queue_name: str) -> list[SessionInfo]:
        """Sessions of a session-enabled queue, with their state, lock expiry and message counts."""
        return Sessions(self.broker.entity(QUEUE, limits.check_name_type(queue_name))).list()

    def list_subscription_sessions(self, topic_name: str, subscription_name: str) -> list[SessionInfo]:
        """Sessions of a session-enabled subscription."""
        return Sessions(self.broker.entity(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))).list()


def _reopen(root: str, tier: str, operation_timeout: float, storage_options: dict[str, str]) -> Namespace:
    """A namespace opened again from what Namespace.__reduce__ recorded: the existing one, never a new one."""
    return Namespace(root, tier, operation_timeout=operation_timeout, storage_options=storage_options or None, create=False)
