"""Transactions (docs/semantics.md §7): sends and settlements on one entity and one partition key, in one Delta commit."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from sparkqueue.errors import InvalidOperationError
from sparkqueue.message import Message, ReceivedMessage, send_settings, to_rows
from sparkqueue.model import limits
from sparkqueue.model.entity import Entity, Guard, PendingSettle, utcnow
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.model.topics import without_markers
from sparkqueue.sender import Sender
from sparkqueue.storage.table import partition_of

if TYPE_CHECKING:
    from sparkqueue.namespace import Namespace
    from sparkqueue.receiver import Receiver

log = logging.getLogger(__name__)


@dataclass
class Transaction:
    """Collects sends and settlements; `commit` applies them all in one commit, or none of them.

    Used as `with ns.transaction() as tx:` — inside the block, senders and receivers of the
    namespace (in this thread) record their operations here instead of applying them.
    """

    namespace: Namespace
    _entity: Entity | None = None
    _entity_key: tuple[str, str] | None = None
    _messages: list[Message] = field(default_factory=list)
    _rows: list[pa.Table] = field(default_factory=list)
    _key: str | None = None
    _session: str | None = None
    _settles: list[PendingSettle] = field(default_factory=list)
    _settle_partition: int | None = None
    _done: bool = False

    def __enter__(self) -> Transaction:
        if self.namespace._active_transaction is not None:
            raise InvalidOperationError("a transaction is already open in this thread; transactions do not nest")
        self.namespace._local.transaction = self
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.namespace._local.transaction = None
        if exc_type is None:
            self.commit()
        else:
            log.debug("transaction discarded after %s", exc_type)
        self._done = True

    # ---- recording -------------------------------------------------------------------------------

    def _bind(self, entity_type: str, name: str) -> Entity:
        """The one entity of the transaction; a second entity is an error."""
        if self._done:
            raise InvalidOperationError("the transaction has already finished")
        key = (entity_type, name)
        if self._entity_key is None:
            self._entity_key = key
            self._entity = self.namespace.broker.entity(entity_type, name)
        elif self._entity_key != key:
            raise InvalidOperationError(
                f"a transaction acts on one entity; it already holds {self._entity_key[1]!r}, not {name!r}"
            )
        assert self._entity is not None
        return self._entity

    def add_send(self, sender: Sender, messages: list[Message]) -> None:
        """Record messages to send; each needs the transaction's one partition key (and session)."""
        entity = self._bind(sender.entity_type, sender.entity_name)
        rows, keys = to_rows(messages, send_settings(self.namespace.tier, entity.props), utcnow())
        for m, key in zip(messages, keys, strict=True):
            if key is None:
                raise InvalidOperationError(
                    "every message sent in a transaction needs a partition key: set session_id or partition_key "
                    "(or message_id on a duplicate-detecting entity)"
                )
            if self._key is not None and key != self._key:
                raise InvalidOperationError(
                    f"all messages of a transaction must share one partition key; got {key!r} after {self._key!r}"
                )
            if self._messages and m.session_id != self._session:
                raise InvalidOperationError("the messages of a transaction may not belong to different sessions")
            self._key, self._session = key, m.session_id
            self._messages.append(m)
        self._check_size()
        self._rows.append(rows)

    def add_settle(
        self,
        receiver: Receiver,
        messages: list[ReceivedMessage],
        op: str,
        reason: str | None,
        description: str | None,
        guard: Guard | None = None,
    ) -> None:
        """Record a settlement; all settled messages must be in the transaction's partition."""
        self._bind(receiver.entity_type, receiver.entity_name)
        parts = {partition_of(m.sequence_number) for m in messages}
        if self._settle_partition is not None:
            parts.add(self._settle_partition)
        if len(parts) > 1:
            raise InvalidOperationError("the messages settled in a transaction must all be in one partition")
        self._settle_partition = parts.pop() if parts else None
        items = [(m.sequence_number, m.lock_token or "") for m in messages]
        self._settles.append(PendingSettle(op, items, reason, description, guard))
        self._check_size()

    def _check_size(self) -> None:
        ops = len(self._messages) + sum(len(s.items) for s in self._settles)
        if ops > limits.MAX_TRANSACTION_MESSAGES:
            raise InvalidOperationError(f"a transaction holds at most {limits.MAX_TRANSACTION_MESSAGES} messages")

    # ---- commit ---------------------------------------------------------------------------------

    def commit(self) -> list[int]:
        """Apply everything in one commit; returns the sequence numbers of the sent messages."""
        if self._entity is None:
            return []
        entity = self._entity
        partition = self._partition(entity)
        rows = pa.concat_tables(self._rows) if self._rows else None
        entity_type, name = self._entity_key or ("", "")
        expand = self.namespace.broker.expander(entity_type, name) if rows is not None else None  # topic fan-out
        stored = entity.transact(partition, rows, self._settles, expand)
        if stored is None:
            return []
        stored = without_markers(stored)
        if stored.num_rows and entity_type in ("queue", "topic"):
            self.namespace.broker.after_send(entity_type, name, [partition])  # auto-forward what arrived
        seqs: list[int] = stored.column("sequence_number").to_pylist()
        return seqs

    def _partition(self, entity: Entity) -> int:
        """The one partition the transaction writes: its key's, which must also hold the settled messages."""
        if self._key is None:
            assert self._settle_partition is not None
            return self._settle_partition
        p = partition_for_key(self._key, entity.partition_count)
        if self._settle_partition is not None and self._settle_partition != p:
            raise InvalidOperationError(
                f"the settled messages are in partition {self._settle_partition}, but the partition key "
                f"{self._key!r} selects partition {p}; a transaction works in one partition"
            )
        return p
