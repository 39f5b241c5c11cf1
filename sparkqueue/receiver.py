"""Receivers (SDK: ServiceBusReceiver): receive, settle, peek and browse one queue or subscription."""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow.compute as pc

from sparkqueue.auto_lock_renewer import AutoLockRenewer
from sparkqueue.broker import Broker, open_transaction, refuse_in_transaction
from sparkqueue.constants import NEXT_AVAILABLE_SESSION, ReceiveMode, SubQueue
from sparkqueue.errors import (
    InvalidArgumentTypeError,
    InvalidOperationError,
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    SparkQueueError,
)
from sparkqueue.message import ReceivedMessage, is_settled, lock_expired, mark_settled, mark_settling, received_messages
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.deadlines import call_timeout, check_timeout
from sparkqueue.model.entity import ROW_COLUMNS, Entity, utcnow
from sparkqueue.model.properties import check_receivable
from sparkqueue.model.sessions import SessionLock, Sessions
from sparkqueue.storage.schema import KIND_MESSAGE, STATE_DEFERRED, SUB_QUEUE_DEAD_LETTER, SUB_QUEUE_MAIN
from sparkqueue.storage.table import partition_of
from sparkqueue.storage.table import sequence_number as compose_sequence

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sparkqueue.namespace import Namespace

log = logging.getLogger(__name__)


MAX_RECEIVE_BATCH = 2**31 - 1
MAX_PREFETCH = 50_000  # as the SDK
# Messages a session accept locks with the session in its one commit (held in the receiver's cache).
SESSION_ACCEPT_PREFETCH = 100  # messages an accept delivers at most (with a prefetch_count), in the accept's commit


class Receiver:
    """Receives from one queue or subscription (or its dead-letter sub-queue); a context manager and an iterator.

    `name` is the catalog's (a subscription's "<topic>|<subscription>"), checked by the Namespace method that made it.
    """

    def __init__(
        self,
        namespace: Namespace,
        entity_type: str,
        name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
        session_id: str | object | None = None,
        auto_lock_renewer: AutoLockRenewer | None = None,
    ) -> None:
        if auto_lock_renewer is not None and not isinstance(auto_lock_renewer, AutoLockRenewer):
            raise InvalidArgumentTypeError(
                f"auto_lock_renewer must be an AutoLockRenewer, got {type(auto_lock_renewer).__name__}"
            )
        try:
            self.receive_mode = ReceiveMode(receive_mode)
        except ValueError:
            raise InvalidOperationError(f"receive_mode must be a ReceiveMode, got {receive_mode!r}") from None
        if auto_lock_renewer is not None and self.receive_mode == ReceiveMode.RECEIVE_AND_DELETE and session_id is None:
            raise InvalidOperationError("auto_lock_renewer cannot be used in RECEIVE_AND_DELETE mode: its messages hold no lock")
        if sub_queue is not None:
            try:
                SubQueue(sub_queue)
            except ValueError:
                raise InvalidOperationError(f"sub_queue must be SubQueue.DEAD_LETTER or None, got {sub_queue!r}") from None
        self.prefetch_count = limits.check_int(prefetch_count, "prefetch_count", minimum=0, maximum=MAX_PREFETCH)
        self.max_wait_time = limits.wait_seconds(max_wait_time, "max_wait_time")
        self._ns = namespace
        self.entity_type = entity_type
        self.entity_name = name
        self._sub_queue = SUB_QUEUE_DEAD_LETTER if sub_queue is not None else SUB_QUEUE_MAIN
        self._cache: deque[ReceivedMessage] = deque()
        self._peek_cursors: dict[int, int] = {}
        self._closed = False
        self._auto_lock_renewer = auto_lock_renewer
        self.session: ReceiverSession | None = None
        entity = self._entity()  # fail fast on an unknown entity
        # The dead-letter sub-queue of a session-enabled entity is read without a session (docs/semantics.md §5).
        requires_session = bool(getattr(entity.props, "requires_session", False)) and sub_queue is None
        if session_id is None and requires_session:
            raise InvalidOperationError(
                f"{entity.name!r} requires sessions: pass session_id=<id> or session_id=NEXT_AVAILABLE_SESSION"
            )
        if session_id is not None:
            if sub_queue is not None:
                raise InvalidOperationError("the dead-letter sub-queue is read without a session")
            if not requires_session:
                raise InvalidOperationError(f"{entity.name!r} is not session-enabled; create it with requires_session=True")
            sid = None if session_id is NEXT_AVAILABLE_SESSION else limits.check_key(session_id, "session_id")
            self._check_receivable()
            namespace.broker.forward_owed(entity_type, name)  # what others owe may start a session (Broker.forward_owed)
            sessions = Sessions(entity)
            # With a prefetch, the accept commit also locks the session's first messages (docs/storage.md): they wait in
            # the cache and count a delivery, as the SDK's prefetch does. Without one, nothing is delivered before a receive.
            prefetch = min(self.prefetch_count, SESSION_ACCEPT_PREFETCH) if self.receive_mode == ReceiveMode.PEEK_LOCK else 0
            lock, first = sessions.accept(sid, self.max_wait_time, prefetch=prefetch)
            self.session = ReceiverSession(sessions, lock, namespace.broker)
            self._cache.extend(received_messages(first, utcnow()))
            if auto_lock_renewer is not None:
                try:
                    auto_lock_renewer.register(self, self.session)
                except BaseException:  # a closed renewer, say: give the session back instead of leaving it locked
                    self.close()
                    raise

    def _entity(self) -> Entity:
        return self._ns.broker.entity(self.entity_type, self.entity_name)

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the receiver is closed (it then refuses every call)."""
        return self._closed

    def __enter__(self) -> Receiver:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release prefetched messages, and the session lock, so other receivers get them at once.

        Never raises, as the SDK's close: what cannot be released (entity deleted, partition down)
        is logged, and its locks lapse at expiry.
        """
        if self._closed:
            return
        try:
            if self.session is not None:
                self.session._closed = True  # its state and lock calls are refused from now on, as the receiver's
                self.session._release([m.sequence_number for m in self._cache])
            elif self._cache and self.receive_mode == ReceiveMode.PEEK_LOCK:
                self._release_cache()
        except Exception as exc:
            log.warning("closing a receiver of %r released nothing (%r); its locks lapse at expiry", self.entity_name, exc)
        finally:
            self._cache.clear()
            self._closed = True

    def _release_cache(self) -> None:
        """Give back the prefetched messages with their delivery undone (never handed out), partition by partition.

        A release, not a settlement: applied at once, never joining an open transaction.
        """
        entity = self._entity()
        by_partition: dict[int, list[tuple[int, str]]] = {}
        for m in self._cache:
            by_partition.setdefault(partition_of(m.sequence_number), []).append((m.sequence_number, m.lock_token or ""))
        for items in by_partition.values():
            try:
                entity.settle(self._sub_queue, items, lifecycle.RELEASE)
            except SparkQueueError as exc:  # the other partitions' messages are still released
                log.warning("closing a receiver of %r left %d message(s) locked until expiry (%r)", entity.name, len(items), exc)

    def __iter__(self) -> Iterator[ReceivedMessage]:
        """The receiver is its own iterator: messages as they arrive, ending after max_wait_time with none."""
        return self

    def __next__(self) -> ReceivedMessage:
        """The next message (`next(receiver)`); StopIteration when none arrives within the receiver's max_wait_time."""
        got = self.receive_messages(max_message_count=1)
        if not got:
            raise StopIteration
        return got[0]

    # ---- receive -------------------------------------------------------------------------------

    def receive_messages(
        self, max_message_count: int | None = 1, max_wait_time: float | timedelta | None = None, *, timeout: float | None = None
    ) -> list[ReceivedMessage]:
        """Up to max_message_count messages from all partitions, waiting up to max_wait_time for the first."""
        n = limits.check_int(1 if max_message_count is None else max_message_count, "max_message_count")
        wait = limits.wait_seconds(max_wait_time, "max_wait_time") if max_wait_time is not None else self.max_wait_time
        bound = check_timeout(timeout)
        if bound is not None:
            wait = min(wait, bound)
        self._check_open()
        self._check_receivable()
        self._check_renewer()
        with call_timeout(bound):
            out = self._receive(n, wait)
        if self.session is not None:
            self.session._track(out)  # their lock is the session's: renewing the session renews theirs
        elif self._auto_lock_renewer is not None and self.receive_mode == ReceiveMode.PEEK_LOCK:
            for m in out:
                self._auto_lock_renewer.register(self, m)
        return out

    def _receive(self, n: int, wait: float) -> list[ReceivedMessage]:
        out: list[ReceivedMessage] = []
        now = utcnow()
        if self.session is not None and self._cache and lock_expired(self.session.locked_until_utc) and not self._deleting:
            self._cache.clear()  # the session lock is gone: the next holder gets them; the receive below raises
            # (RECEIVE_AND_DELETE: the store holds them no more, so they are handed out below all the same)
        if self.session is not None and self.session._rewind:
            # A message was abandoned: it comes back before the later messages waiting in the cache. The store's
            # first n available messages merged with the cache give this receive's first n exactly; the rewind
            # ends only once the store holds nothing earlier than a cached message (a short fetch, or one
            # reaching past the cache), so each of several abandoned messages comes back in its turn.
            rows = self.session._sessions.receive(self.session._lock, n, delete=self._deleting, wait_s=0.0)
            got = received_messages(rows, utcnow())
            if len(got) < n or not self._cache or got[-1].sequence_number > self._cache[-1].sequence_number:
                self.session._rewind = False
            merged = sorted([*got, *self._cache], key=lambda m: m.sequence_number)
            self._cache = deque(merged)
        while self._cache and len(out) < n:
            m = self._cache.popleft()
            # A session's cached messages hold the session lock (checked above), not a lock of their own.
            if (
                self.receive_mode == ReceiveMode.RECEIVE_AND_DELETE
                or self.session is not None
                or (m.locked_until_utc and m.locked_until_utc > now)
            ):
                out.append(m)
        if len(out) >= n or (out and self.session is not None):
            return out  # a session's cached messages are its next ones: no read for more until they are taken
        want = min(n - len(out) + self.prefetch_count, MAX_RECEIVE_BATCH)
        wait_s = 0.0 if out else wait
        if self._sub_queue == SUB_QUEUE_MAIN:  # at most every few seconds (Broker.forward_owed)
            self._ns.broker.forward_owed(self.entity_type, self.entity_name)
        if self.session is not None:
            rows = self.session._sessions.receive(self.session._lock, want, delete=self._deleting, wait_s=wait_s)
        else:
            check = self._check_receivable
            rows = self._entity().receive(self._sub_queue, want, delete=self._deleting, wait_s=wait_s, check=check)
        got = received_messages(rows, utcnow())
        take = n - len(out)
        out.extend(got[:take])
        self._cache.extend(got[take:])
        return out

    def _check_receivable(self) -> None:
        """Refuse receives the entity's status disables, and receives from the main sub-queue of an auto-forwarding entity."""
        entity = self._entity()
        check_receivable(entity.props, entity.name, dead_letters=self._sub_queue == SUB_QUEUE_DEAD_LETTER)

    @property
    def _deleting(self) -> bool:
        return self.receive_mode == ReceiveMode.RECEIVE_AND_DELETE

    def receive_deferred_messages(
        self, sequence_numbers: int | Sequence[int], *, timeout: float | None = None
    ) -> list[ReceivedMessage]:
        """Receive deferred messages by sequence number.

        A sequence number that is not a deferred message of this entity (or of the held session) —
        completed, never deferred, unknown — raises MessageNotFoundError and nothing is received, as
        in the SDK. A deferred message another receiver holds locked right now is not returned.
        """
        seqs = limits.check_sequence_numbers(sequence_numbers)
        self._check_open()
        self._check_receivable()  # a receive too: refused while disabled or auto-forwarding
        self._check_renewer()
        with call_timeout(timeout):
            self._require_deferred(seqs)
            if self.session is not None:  # only the held session's deferred messages, under its lock
                rows = self.session._sessions.receive_deferred(self.session._lock, seqs, delete=self._deleting)
            else:
                rows = self._entity().receive_deferred(self._sub_queue, seqs, delete=self._deleting)
        out = received_messages(rows, utcnow())
        if self.session is not None:
            self.session._track(out)
        elif self._auto_lock_renewer is not None and self.receive_mode == ReceiveMode.PEEK_LOCK:
            for m in out:
                self._auto_lock_renewer.register(self, m)
        return out

    def _require_deferred(self, seqs: list[int]) -> None:
        """MessageNotFoundError naming the sequence numbers that are not deferred messages of this receiver."""
        entity = self._entity()
        dt = entity.table.snapshot()
        missing: list[int] = []
        groups: dict[int, list[int]] = {}
        for seq in seqs:
            groups.setdefault(partition_of(seq), []).append(seq)
        for p, group in groups.items():
            if p >= entity.partition_count:
                missing.extend(group)
                continue
            rows = entity.table.rows_by_sequence(dt, p, group, ROW_COLUMNS, entity.subscription)
            mask = pc.and_(
                pc.and_(pc.equal(rows.column("state"), STATE_DEFERRED), pc.equal(rows.column("sub_queue"), self._sub_queue)),
                pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), entity.owns(rows)),
            )
            if self.session is not None:
                mask = pc.and_(mask, pc.fill_null(pc.equal(rows.column("session_id"), self.session.session_id), False))
            found = set(rows.filter(mask).column("sequence_number").to_pylist())
            missing.extend(s for s in group if s not in found)
        if missing and self.session is not None:
            self.session._sessions.check(self.session._lock)  # a lost session lock is reported first, as in the SDK
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise MessageNotFoundError(
                f"no deferred message with sequence number(s) {shown} in {entity.name!r}"
                + (f" session {self.session.session_id!r}" if self.session is not None else "")
                + "; nothing was received"
            )

    def peek_messages(
        self, max_message_count: int = 1, sequence_number: int | None = None, *, timeout: float | None = None
    ) -> list[ReceivedMessage]:
        """Browse without locking, in sequence order (partition by partition); later calls continue where this one stopped.

        `sequence_number` starts at the first message numbered at least that; it may be passed by position as well as
        by keyword, the SDK's way (docs/semantics.md §5).
        """
        n = limits.check_int(max_message_count, "max_message_count")
        if sequence_number is not None:
            limits.check_sequence_number(sequence_number, "sequence_number")
        self._check_open()
        with call_timeout(timeout):
            return self._peek(n, sequence_number)

    def _peek(self, n: int, sequence_number: int | None) -> list[ReceivedMessage]:
        entity = self._entity()
        if self.session is not None:  # a session receiver browses its own session only
            lock = self.session._lock
            if sequence_number is not None:
                self._peek_cursors = {lock.partition: _peek_cursor(lock.partition, sequence_number)}
            rows = self.session._sessions.peek(lock, self._peek_cursors.get(lock.partition), n)
            if rows.num_rows:
                self._peek_cursors[lock.partition] = rows.column("sequence_number")[-1].as_py() + 1
            peeked = received_messages(rows, utcnow())
            for m in peeked:
                m.lock_token = None
            return peeked
        if sequence_number is not None:
            self._peek_cursors = {p: _peek_cursor(p, sequence_number) for p in range(entity.partition_count)}
        rows = entity.peek(self._sub_queue, self._peek_cursors, n)
        peeked = received_messages(rows, utcnow())
        for m in peeked:
            m.lock_token = None  # a browse holds no lock: never hand out another receiver's token
        return peeked

    # ---- settle --------------------------------------------------------------------------------

    def complete_message(self, message: ReceivedMessage) -> None:
        """Remove the message: it was processed."""
        self._settle(message, lifecycle.COMPLETE)

    def abandon_message(self, message: ReceivedMessage) -> None:
        """Release the lock: the message is available again at once."""
        self._settle(message, lifecycle.ABANDON)

    def defer_message(self, message: ReceivedMessage) -> None:
        """Set the message aside; only receive_deferred_messages delivers it again."""
        self._settle(message, lifecycle.DEFER)

    def dead_letter_message(
        self, message: ReceivedMessage, reason: str | None = None, error_description: str | None = None
    ) -> None:
        """Move the message to the dead-letter sub-queue with a reason (each text at most 4,096 characters)."""
        for value, field in ((reason, "reason"), (error_description, "error_description")):
            limits.check_text(value, field, limits.MAX_DEAD_LETTER_TEXT)
        self._settle(message, lifecycle.DEAD_LETTER, reason, error_description)

    def renew_message_lock(self, message: ReceivedMessage, *, timeout: float | None = None) -> datetime:
        """Extend the lock by the entity's lock_duration; returns the new expiry.

        A session's messages have no lock of their own: renewing one raises TypeError, as in the
        SDK; renew the session lock (`receiver.session.renew_lock()`) instead.
        """
        if self.session is not None:
            raise TypeError("session messages cannot be renewed; renew the session lock with receiver.session.renew_lock()")
        with call_timeout(timeout):
            until = self._settle(message, lifecycle.RENEW)
        assert until is not None
        message.locked_until_utc = until
        return until

    def complete_messages(self, messages: Sequence[ReceivedMessage]) -> None:
        """Complete many messages in one commit per partition (sparkqueue extension; the SDK settles one at a time).

        Messages whose lock still holds are completed; if any lock was lost, MessageLockLostError
        names those messages after the others were completed.
        """
        self._settle_many(list(messages), lifecycle.COMPLETE)

    def abandon_messages(self, messages: Sequence[ReceivedMessage]) -> None:
        """Abandon many messages in one commit per partition (sparkqueue extension)."""
        self._settle_many(list(messages), lifecycle.ABANDON)

    def _settle(
        self, message: ReceivedMessage, op: str, reason: str | None = None, description: str | None = None
    ) -> datetime | None:
        return self._settle_many([message], op, reason, description)[0]

    def _settle_many(
        self, messages: list[ReceivedMessage], op: str, reason: str | None = None, description: str | None = None
    ) -> list[datetime | None]:
        """Settle messages with `op`; raise MessageLockLostError for those whose lock is not current."""
        ok, until = self._settle_outcome(messages, op, reason, description)
        lost = [m for m, held in zip(messages, ok, strict=True) if not held]
        if lost:
            names = ", ".join(f"{m.sequence_number} ({m.message_id!r})" for m in lost[:5])
            more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            raise MessageLockLostError(
                f"the lock on message(s) {names}{more} expired or was taken by a later delivery, or they were not "
                f"received from {self.entity_name!r}; the settlement was not applied to them. Receive them again"
            )
        return until

    def renew_message_locks(self, messages: Sequence[ReceivedMessage]) -> list[bool]:
        """Renew many message locks in one commit per partition (sparkqueue extension; AutoLockRenewer's batches); which held.

        Those renewed get their new `locked_until_utc`; a lost lock is reported, not raised. A
        session's messages have no lock of their own: TypeError, as renew_message_lock.
        """
        if self.session is not None:
            raise TypeError("session messages cannot be renewed; renew the session lock with receiver.session.renew_lock()")
        messages = list(messages)
        ok, until = self._settle_outcome(messages, lifecycle.RENEW)
        for m, held, new in zip(messages, ok, until, strict=True):
            if held and new is not None:
                m.locked_until_utc = new
        return ok

    def _settle_outcome(
        self, messages: list[ReceivedMessage], op: str, reason: str | None = None, description: str | None = None
    ) -> tuple[list[bool], list[datetime | None]]:
        """Settle messages with `op`: which locks held, and (for a renewal) the new expiries; a lost lock is not raised."""
        self._check_open()
        for message in messages:
            if not isinstance(message, ReceivedMessage):
                raise InvalidArgumentTypeError(f"expected a ReceivedMessage, got {type(message).__name__}")
            if self.receive_mode == ReceiveMode.RECEIVE_AND_DELETE:
                raise InvalidOperationError("messages received in RECEIVE_AND_DELETE mode are already settled")
            if message.lock_token is None:
                raise InvalidOperationError("the message has no lock token: peeked messages cannot be settled")
            limits.check_sequence_number(message.sequence_number, "the message's sequence_number")  # as received, unchanged
            limits.check_text(message.lock_token, "the message's lock_token", 64)
            if is_settled(message):
                raise MessageAlreadySettled(f"message {message.sequence_number} was already settled; nothing was changed")
        if not messages:
            return [], []
        items = [(m.sequence_number, m.lock_token or "") for m in messages]
        lock = self.session._lock if self.session is not None else None  # a session's messages settle under its lock
        tx = open_transaction(self._ns.broker)
        if tx is None:
            self._settled(messages, op, None)  # before the call: an abandon that failed after landing still rewinds
        owners = [(m.session_id, m.partition_key) for m in messages] if tx is not None else ()  # checked against its key
        settling = op != lifecycle.RENEW and tx is None  # an auto lock renewal failing meanwhile lost the lock to this
        if settling:
            mark_settling(messages, True)
        try:
            res = self._ns.broker.settle(
                self.entity_type,
                self.entity_name,
                items,
                op,
                reason,
                description,
                sub_queue=self._sub_queue,
                session=lock,
                owners=owners,
            )
            if res is None:  # recorded by the open transaction: applied, all of it, when it commits
                assert tx is not None
                tx.on_commit(lambda: self._settled(messages, op, [True] * len(messages)))
                return [True] * len(messages), [None] * len(messages)
            self._settled(messages, op, res.ok)
        finally:
            if settling:
                mark_settling(messages, False)
        return res.ok, res.locked_until

    def _settled(self, messages: list[ReceivedMessage], op: str, ok: list[bool] | None) -> None:
        """Client-side effects of a settlement: an abandon in a session rewinds the cache; `ok` ones are marked settled."""
        if self.session is not None and op == lifecycle.ABANDON:
            self.session._rewind = True
        if ok is not None and op != lifecycle.RENEW:
            for m, held in zip(messages, ok, strict=True):
                if held:
                    mark_settled(m)

    # ---- DataFrames (sparkqueue.spark, imported lazily: pyspark is optional) -------------------

    def receive_dataframe(self, max_message_count: int, spark: SparkSession | None = None) -> DataFrame:
        """Lock up to max_message_count messages in Spark tasks, one per partition (docs/semantics.md §12)."""
        from sparkqueue.spark.receive import receive_dataframe

        self._check_dataframe()
        self._check_receivable()
        return receive_dataframe(
            self._ns.broker,
            self.entity_type,
            self.entity_name,
            max_message_count,
            spark,
            sub_queue=self._sub_queue,
            delete=self._deleting,
            wait_s=self.max_wait_time,
        )

    def complete_dataframe(self, df: DataFrame) -> DataFrame:
        """Complete the messages of df's `lock_token` column; a DataFrame of (lock_token, status "ok"/"lock_lost")."""
        return self._settle_dataframe(df, lifecycle.COMPLETE)

    def abandon_dataframe(self, df: DataFrame) -> DataFrame:
        """Abandon the messages of df's `lock_token` column; a DataFrame of (lock_token, status)."""
        return self._settle_dataframe(df, lifecycle.ABANDON)

    def defer_dataframe(self, df: DataFrame) -> DataFrame:
        """Defer the messages of df's `lock_token` column; a DataFrame of (lock_token, status)."""
        return self._settle_dataframe(df, lifecycle.DEFER)

    def dead_letter_dataframe(self, df: DataFrame, reason: str | None = None, error_description: str | None = None) -> DataFrame:
        """Dead-letter df's messages (per-row `dead_letter_reason`/`dead_letter_error_description` columns win); statuses."""
        return self._settle_dataframe(df, lifecycle.DEAD_LETTER, reason, error_description)

    def _settle_dataframe(
        self, df: DataFrame, op: str, reason: str | None = None, error_description: str | None = None
    ) -> DataFrame:
        from sparkqueue.spark.settle import settle_dataframe

        self._check_dataframe()
        if self.receive_mode == ReceiveMode.RECEIVE_AND_DELETE:
            raise InvalidOperationError("messages received in RECEIVE_AND_DELETE mode are already settled")
        return settle_dataframe(
            self._ns.broker, self.entity_type, self.entity_name, df, op, reason, error_description, sub_queue=self._sub_queue
        )

    def _check_dataframe(self) -> None:
        """DataFrame calls need an open receiver without a session (sessions use the message API)."""
        self._check_open()
        if self.session is not None:
            raise InvalidOperationError(
                "session receivers receive and settle with the message API; DataFrames cover sessionless entities"
            )

    # ---- helpers -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidOperationError("the receiver is closed; get a new one from the namespace")

    def _check_renewer(self) -> None:
        """A closed auto_lock_renewer is refused before a receive takes anything it would then leave locked and counted."""
        if self._auto_lock_renewer is not None and self.receive_mode == ReceiveMode.PEEK_LOCK and self.session is None:
            self._auto_lock_renewer._check_open()


def _peek_cursor(partition: int, sequence_number: int) -> int:
    """Where a partition's browse starts for peek_messages(sequence_number=n): at the first number >= n.

    Numbers carry their partition in the top bits and a peek returns partitions in order, so
    `peek_messages(k, sequence_number=last.sequence_number + 1)` pages through every message once,
    as the SDK's loop expects: earlier partitions are past, n's own starts at n, later ones at their start.
    """
    if partition < partition_of(sequence_number):
        return compose_sequence(partition + 1, 0)  # past every number of this partition
    if partition > partition_of(sequence_number):
        return compose_sequence(partition, 0)
    return sequence_number


class ReceiverSession:
    """The session a session receiver holds (SDK: ServiceBusSession): its state and lock."""

    def __init__(self, sessions: Sessions, lock: SessionLock, broker: Broker) -> None:
        self._sessions = sessions
        self._broker = broker  # whose open transaction, if any, the state and lock calls may not join
        self._lock = lock
        self._max_state_bytes = limits.MAX_MESSAGE_BYTES[broker.tier]  # Service Bus bounds session state by the message size
        self.auto_renew_error: BaseException | None = None
        self._delivered: list[weakref.ref[ReceivedMessage]] = []  # handed-out messages whose lock is this session's
        self._rewind = False  # a message was abandoned: the next receives look before the cached messages
        self._closed = False  # its receiver was closed: the session lock was released

    @property
    def session_id(self) -> str:
        """The locked session's id."""
        return self._lock.session_id

    @property
    def locked_until_utc(self) -> datetime:
        """When the session lock expires unless renewed."""
        return self._lock.locked_until

    def get_state(self, *, timeout: float | None = None) -> bytes | None:
        """The session state (None when never set or cleared)."""
        self._check_open()
        with call_timeout(timeout):
            return self._sessions.get_state(self._lock)

    def set_state(self, state: bytes | str | None, *, timeout: float | None = None) -> None:
        """Store the session state (str as UTF-8; at most the tier's message size), or clear it.

        None clears it, and so does an empty value: Service Bus reads an empty state as none.
        """
        if isinstance(state, str):
            state = limits.check_utf8(state, "session state").encode("utf-8")
        if state is not None and not isinstance(state, (bytes, bytearray)):
            raise InvalidArgumentTypeError(f"session state must be bytes, str or None, got {type(state).__name__}")
        if state is not None and len(state) > self._max_state_bytes:
            raise MessageSizeExceededError(
                f"session state of {len(state)} bytes exceeds the {self._max_state_bytes} bytes a session state may hold"
            )
        self._check_open()
        refuse_in_transaction(self._broker, "session state cannot be set inside a transaction (it would not roll back with it)")
        with call_timeout(timeout):
            self._sessions.set_state(self._lock, bytes(state) if state else None)

    def renew_lock(self, *, timeout: float | None = None) -> datetime:
        """Extend the session lock by the entity's lock_duration; returns the new expiry."""
        self._check_open()
        refuse_in_transaction(self._broker, "locks cannot be renewed inside a transaction")
        with call_timeout(timeout):
            until = self._sessions.renew(self._lock)
        for ref in self._delivered:
            m = ref()
            if m is not None and m.lock_token is not None:
                m.locked_until_utc = until
        return until

    def _track(self, messages: list[ReceivedMessage]) -> None:
        """Remember handed-out messages, so their locked_until_utc follows the session lock."""
        self._delivered = [r for r in self._delivered if r() is not None and not is_settled(r())]
        for m in messages:
            if m.lock_token is not None:
                m.locked_until_utc = self._lock.locked_until
                self._delivered.append(weakref.ref(m))

    def _check_open(self) -> None:
        """Refuse calls once the receiver is closed, with the receiver's own error (the SDK's closed handler refuses them)."""
        if self._closed:
            raise InvalidOperationError("the receiver is closed and its session released; accept the session again")

    def _release(self, undelivered: Sequence[int] = ()) -> None:
        self._sessions.release(self._lock, undelivered)
