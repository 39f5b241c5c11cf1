"""Transactions (docs/semantics.md §7): sends and settlements on one entity and one partition key, in one Delta commit.

The open transactions travel in a ContextVar: while `with ns.transaction():` is open in a thread
(or an asyncio task), that broker's `send` and `settle` record into it instead of applying, so no
API object has to carry it. A thread started with `threading.Thread` starts with an empty
context, outside any transaction; code run in a copy of the context (`asyncio.to_thread`) joins it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from sparkqueue.errors import InvalidOperationError, MessageAlreadySettled
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.addresses import QUEUE, TOPIC
from sparkqueue.model.entity import Entity, Guard, PendingSettle
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.model.topics import without_markers
from sparkqueue.storage.table import partition_of

if TYPE_CHECKING:
    from sparkqueue.broker.core import Broker

log = logging.getLogger(__name__)

_OPEN: ContextVar[tuple[Transaction, ...]] = ContextVar("sparkqueue_transactions", default=())


def open_transaction(broker: Broker) -> Transaction | None:
    """The transaction open in this context on `broker` (a transaction of another namespace does not capture it)."""
    return next((tx for tx in _OPEN.get() if tx.broker is broker), None)


def refuse_in_transaction(broker: Broker, refusal: str) -> None:
    """Raise InvalidOperationError(refusal) while a transaction is open on `broker`: the operation cannot join it."""
    if open_transaction(broker) is not None:
        raise InvalidOperationError(refusal)


@dataclass
class Transaction:
    """Collects sends and settlements; `commit` applies them all in one commit, or none of them.

    Used as `with ns.transaction() as tx:` — inside the block, the namespace's senders and
    receivers (in this context) record their operations here instead of applying them.
    """

    broker: Broker
    _entity: Entity | None = None
    _entity_key: tuple[str, str] | None = None
    _rows: list[pa.Table] = field(default_factory=list)
    _sent: int = 0
    _key: str | None = None
    _session: str | None = None
    _settles: list[PendingSettle] = field(default_factory=list)
    _settle_partition: int | None = None
    _settled: set[int] = field(default_factory=set)  # sequence numbers this transaction settles
    _done: bool = False
    _committed: list[Callable[[], None]] = field(default_factory=list)
    _token: Token[tuple[Transaction, ...]] | None = None

    def __enter__(self) -> Transaction:
        if self._done:
            raise InvalidOperationError("the transaction has already finished; start a new one with ns.transaction()")
        if open_transaction(self.broker) is not None:
            raise InvalidOperationError("a transaction of this namespace is already open here; transactions do not nest")
        if self._token is not None:  # entered by another thread or task: its exit would commit this one's operations
            raise InvalidOperationError("the transaction is already open in another thread or task; each needs its own")
        self._token = _OPEN.set((*_OPEN.get(), self))
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._token is not None:
            _OPEN.reset(self._token)
            self._token = None
        if exc_type is None and not self._done:  # a commit inside the block finished it already
            self.commit()
        elif exc_type is not None:
            log.debug("transaction discarded after %s", exc_type)
        self._done = True

    # ---- recording (called by Broker.send and Broker.settle) ---------------------------------------

    def _bound(self, entity_type: str, name: str) -> tuple[tuple[str, str], Entity]:
        """The one entity of the transaction (by its stored name: any spelling of it is the same); a second is an error.

        Only checked: an operation `_bind`s it once every check of its own has passed, so a refused one changes nothing.
        """
        if self._done:
            raise InvalidOperationError("the transaction has already finished")
        key = (entity_type, name)
        if key != self._entity_key:  # the first operation, or another spelling of the entity: look its name up
            key = (entity_type, self.broker.canonical(entity_type, name))
        if self._entity_key is None:
            return key, self.broker.entity(entity_type, name)
        if self._entity_key != key:
            raise InvalidOperationError(
                f"a transaction acts on one entity; it already holds {self._entity_key[1]!r}, not {name!r}"
            )
        assert self._entity is not None
        return key, self._entity

    def _bind(self, key: tuple[str, str], entity: Entity) -> None:
        """Record the transaction's entity (an accepted operation's)."""
        self._entity_key, self._entity = key, entity

    def add_send(self, entity_type: str, name: str, rows: pa.Table, keys: Sequence[str | None]) -> None:
        """Record message rows to send; each needs the transaction's one partition key (and session)."""
        bound = self._bound(entity_type, name)
        if None in keys:
            raise InvalidOperationError(
                "every message sent in a transaction needs a partition key: set session_id or partition_key "
                "(or message_id on a duplicate-detecting entity)"
            )
        joined = self._joined(zip(keys, rows.column("session_id").to_pylist(), strict=True))
        self._check_size(rows.num_rows)
        self._bind(*bound)
        self._key, self._session = joined
        self._sent += rows.num_rows
        self._rows.append(rows)

    def _joined(self, messages: Iterable[tuple[str | None, str | None]]) -> tuple[str | None, str | None]:
        """The transaction's (partition key, session) once keyed messages' (key, session) join it; checked, not recorded.

        InvalidOperationError when a key or session differs from the transaction's (docs/semantics.md §7).
        """
        key0, session0 = self._key, self._session
        for key, session in messages:
            if key0 is not None and key != key0:
                raise InvalidOperationError(
                    f"all messages of a transaction must share one partition key; got {key!r} after {key0!r}"
                )
            if key0 is not None and session != session0:
                raise InvalidOperationError("the messages of a transaction may not belong to different sessions")
            key0, session0 = key, session
        return key0, session0

    def add_settle(
        self,
        entity_type: str,
        name: str,
        sub_queue: str,
        items: Sequence[tuple[int, str]],
        op: str,
        reason: lifecycle.Texts,
        description: lifecycle.Texts,
        guard: Guard | None = None,
        owners: Sequence[tuple[str | None, str | None]] = (),
    ) -> None:
        """Record a settlement of (sequence_number, lock_token) items of `sub_queue`, all in the transaction's partition.

        `owners` holds the settled messages' (session_id, partition_key): a keyed one must have the
        transaction's key and session, as a message it sends.
        """
        bound = self._bound(entity_type, name)
        keyed = [(session if session is not None else key, session) for session, key in owners]
        joined = self._joined(k for k in keyed if k[0] is not None)  # an unkeyed message only has to be in the partition
        seqs = [seq for seq, _ in items]
        seen = set(self._settled)
        for seq in seqs:
            if seq in seen:
                raise MessageAlreadySettled(f"message {seq} is already settled in this transaction; nothing was changed")
            seen.add(seq)
        parts = {partition_of(seq) for seq, _ in items}
        if self._settle_partition is not None:
            parts.add(self._settle_partition)
        if len(parts) > 1:
            raise InvalidOperationError("the messages settled in a transaction must all be in one partition")
        self._check_size(len(items))
        self._bind(*bound)
        self._settle_partition = parts.pop() if parts else None
        self._key, self._session = joined
        self._settles.append(PendingSettle(op, list(items), sub_queue, reason, description, guard))
        self._settled.update(seqs)

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the commit has applied everything (a receiver then marks its messages settled)."""
        self._committed.append(callback)

    def _check_size(self, adding: int) -> None:
        """InvalidOperationError (nothing recorded) when `adding` more operations would pass the transaction's limit."""
        ops = self._sent + sum(len(s.items) for s in self._settles) + adding
        if ops > limits.MAX_TRANSACTION_MESSAGES:
            raise InvalidOperationError(f"a transaction holds at most {limits.MAX_TRANSACTION_MESSAGES} messages")

    # ---- commit ---------------------------------------------------------------------------------

    def commit(self) -> list[int]:
        """Apply everything in one commit; returns the sequence numbers of the sent messages.

        Commits once: the transaction is finished afterwards, also when the commit failed (its
        operations are not applied later); inside the block, its exit then commits nothing more.
        """
        if self._done:
            raise InvalidOperationError("the transaction has already finished; start a new one with ns.transaction()")
        self._done = True
        if self._entity is None or not (self._rows or self._settles):
            return []
        entity = self._entity
        partition = self._partition(entity)
        rows = pa.concat_tables(self._rows) if self._rows else None
        entity_type, name = self._entity_key or ("", "")
        expand = self.broker.expander(entity_type, name) if rows is not None else None  # topic fan-out
        stored = entity.transact(partition, rows, self._settles, expand)
        for callback in self._committed:
            callback()
        if any(st.op == lifecycle.DEAD_LETTER for st in self._settles):
            self.broker.forward_now(entity, [partition])  # forward the dead letters, as Broker.settle does
        if stored is None:
            return []
        stored = without_markers(stored)
        if stored.num_rows and entity_type in (QUEUE, TOPIC):
            self.broker.after_send(entity_type, name, [partition])  # auto-forward what arrived
        seqs: list[int] = stored.column("sequence_number").to_pylist()
        return seqs

    def _partition(self, entity: Entity) -> int:
        """The one partition the transaction writes: its key's, which must also hold the settled messages."""
        if not self._sent:  # settlements only: a settled message's key need not select its partition (rule actions)
            assert self._settle_partition is not None
            return self._settle_partition
        assert self._key is not None
        p = partition_for_key(self._key, entity.partition_count)
        if self._settle_partition is not None and self._settle_partition != p:
            raise InvalidOperationError(
                f"the settled messages are in partition {self._settle_partition}, but the partition key "
                f"{self._key!r} selects partition {p}; a transaction works in one partition"
            )
        return p
