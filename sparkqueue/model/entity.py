"""Operations on one entity (queue or subscription): the broker rules applied over its Delta table.

Works on Arrow tables of rows (ENTITY_SCHEMA); the public API turns them into messages.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import MessageLockLostError, OperationTimeoutError, PartitionUnavailableError, StorageError
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.addresses import Address
from sparkqueue.model.deadlines import effective
from sparkqueue.model.ids import item_arrays
from sparkqueue.model.partitioning import RoundRobin, partition_for_key
from sparkqueue.model.properties import (
    AnyEntityProperties,
    PartitionRuntimeProperties,
    RuntimeProperties,
    SubscriptionProperties,
    TopicProperties,
)
from sparkqueue.model.topics import COPY_KEY, copy_run, live_copies
from sparkqueue.storage.files import MAX_FILE_ROWS, MIN_SPLIT_ROWS
from sparkqueue.storage.log import MARK_PREFIX, CommitConflict, Fence, Snapshot
from sparkqueue.storage.retry import Deadline, backoff, retry_commit
from sparkqueue.storage.schema import (
    ANY_SUBSCRIPTION,
    ENTITY_COLUMNS,
    ENTITY_SCHEMA,
    PARTITION_COLUMN,
    STATE_COLUMNS,
    STATE_DEFERRED,
    SUB_QUEUE_DEAD_LETTER,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    constant,
    in_sequence,
    index_of,
    keep_rows,
    with_columns,
)
from sparkqueue.storage.table import (
    SEQUENCE_BITS,
    SEQUENCE_MASK,
    EntityTable,
    Expand,
    empty_changes,
    fence_app_id,
    partition_of,
    sequence_number,
)

log = logging.getLogger(__name__)

ROW_COLUMNS = ENTITY_COLUMNS[1:]  # every column but the partition id, which lives in the path
LOCK_ATTEMPTS_PER_PARTITION = 3
# A receive takes no new lock after a sixth of the lock duration since it started locking (docs/semantics.md §5): one
# that went on locking partition after partition (or chunk after chunk) under load returned locks about to lapse.
LOCKING_SHARE = 6
# A receive that meets expired (or over-delivered) messages reads this many times more candidates on its next round,
# up to MAX_EXPIRY_SCAN, so a run of them costs a few commits, not one per message.
EXPIRY_SCAN_GROWTH = 4
MAX_EXPIRY_SCAN = 4_096
POLL_MIN_S, POLL_MAX_S = 0.02, 0.5
# How long the main route of an entity rests after an update changed its forward_to (docs/semantics.md §9): longer
# than processes trust cached settings (the broker's PROPERTIES_TTL_S, 1 s), so no two forwarders, or a forwarder
# and a receiver, act on one message by two routes.
ROUTE_QUIET_S = 1.5
COPY_WINDOW = 256  # sequence numbers read either side of a topic message's number to find its copies (widened as needed)


def utcnow() -> datetime:
    """Current time, timezone-aware UTC."""
    return datetime.now(UTC)


Guard = Callable[[Snapshot, int, datetime], "pa.Table | None"]


@dataclass(frozen=True)
class PendingSettle:
    """A settlement recorded in a transaction, applied at its commit."""

    op: str
    items: list[tuple[int, str]]
    sub_queue: str  # the settling receiver's: rows of the other sub-queue are another entity's
    reason: lifecycle.Texts = None
    description: lifecycle.Texts = None
    guard: Guard | None = None  # a session receiver's lock check (and session-row touch), run inside the commit


@dataclass
class SettleResult:
    """Per item of a settlement: did the lock hold, and the new lock expiry for renewals."""

    ok: list[bool]
    locked_until: list[datetime | None]


class Entity:
    """A queue or subscription: send, receive, settle, peek and count, over all its partitions."""

    def __init__(
        self,
        props: AnyEntityProperties,
        table: EntityTable,
        operation_timeout: float,
        subscription: str | None = None,
        on_dead_letters: Callable[[Entity, list[int]], None] | None = None,
    ) -> None:
        self.table = table
        self.on_dead_letters = on_dead_letters  # the namespace forwards what a receive dead-lettered (model/forwarding.py)
        self.props = props
        self.subscription = subscription  # a subscription's rows live in its topic's table
        self.partition_count = table.partition_count
        self.operation_timeout = operation_timeout
        self._send_rr = RoundRobin(self.partition_count)
        self._recv_start = itertools.count(random.randrange(self.partition_count))

    def dead_lettered(self, partitions: list[int]) -> None:
        """Report that a receive dead-lettered messages in these partitions (max delivery count, expiry)."""
        if self.on_dead_letters is not None and partitions:
            self.on_dead_letters(self, partitions)

    @property
    def props(self) -> AnyEntityProperties:
        """The entity's settings (refreshed from the catalog by the namespace)."""
        return self._props

    @props.setter
    def props(self, props: AnyEntityProperties) -> None:
        self._props = props
        if not getattr(props, "topic_name", None):  # a subscription shares its topic's table: the topic's size is its quota
            self.table.max_partition_bytes = int(props.max_size_in_megabytes) * 1024 * 1024

    @property
    def name(self) -> str:
        """The entity's name as users write it ("topic/Subscriptions/subscription" for a subscription)."""
        topic = getattr(self.props, "topic_name", "")
        return Address.subscription_of(topic, self.props.name).path if topic else self.props.name

    @property
    def policy(self) -> lifecycle.Policy:
        """The settings that drive lock-state transitions."""
        # A topic's own rows are never received (only scheduled and cancelled): the defaults serve it.
        p = self.props if not isinstance(self.props, TopicProperties) else SubscriptionProperties(name=self.props.name)
        return lifecycle.Policy(
            lock_duration=p.lock_duration,
            max_delivery_count=p.max_delivery_count,
            dead_lettering_on_message_expiration=p.dead_lettering_on_message_expiration,
            keep_tombstones=self.subscription is None and bool(getattr(p, "requires_duplicate_detection", False)),
            source=self.name,
        )

    def mark_route_change(self) -> None:
        """Record in the table that the main route is changing: it rests for ROUTE_QUIET_S from now (a log-only commit)."""
        app = self._route_app()

        def attempt() -> None:
            dt = self.table.snapshot()
            seen = dt.transaction_version(app)
            self.table.commit(dt, [], [], [Fence(app, (seen or 0) + 1)], {app: seen}, "WRITE")

        retry_commit(attempt, self.deadline(), f"mark a route change of {self.name}")

    def route_rest_left_s(self, dt: Snapshot | None = None) -> float:
        """Seconds the main route still rests after a change (mark_route_change), at most ROUTE_QUIET_S; 0 when it does not.

        Neither forwarders nor receivers of the main sub-queue act on it meanwhile.
        """
        changed_ms = (dt or self.table.snapshot()).txn_times.get(self._route_app())
        if changed_ms is None:
            return 0.0
        return min(ROUTE_QUIET_S, max(0.0, changed_ms / 1000 + ROUTE_QUIET_S - time.time()))

    def wait_route_rest(self) -> None:
        """Sleep out a rest of the main route (route_rest_left_s): for operations that must not come back empty.

        OperationTimeoutError, without waiting, when the rest outlasts the operation's timeout (a call's `timeout=`).
        """
        rest = self.route_rest_left_s()
        if rest <= 0:
            return
        budget = self.deadline().remaining()
        if rest > budget:
            raise OperationTimeoutError(
                f"{self.name!r} changed its forward_to a moment ago; its messages can be taken in {rest:.1f}s, "
                f"after this call's timeout of {budget:g}s: try again"
            )
        time.sleep(rest)

    def _route_app(self) -> str:
        """The txn app id whose moves mark changes of the main route (a topic's subscriptions share one table)."""
        return f"{MARK_PREFIX}route.{self.subscription or ''}"

    def deadline(self) -> Deadline:
        """A deadline of one operation timeout (or the call's tighter `timeout=`) from now."""
        return Deadline(effective(self.operation_timeout))

    def locking_time_s(self, delete: bool = False) -> float:
        """How long a receive keeps taking more locks after its first (LOCKING_SHARE); a RECEIVE_AND_DELETE one has no bound."""
        return math.inf if delete else self.policy.lock_duration.total_seconds() / LOCKING_SHARE

    def available(self, partition: int) -> bool:
        """False while a fault is injected on the partition."""
        return self.table.available(partition)

    # ---- send ------------------------------------------------------------------------------

    def place(self, keys: Sequence[str | None]) -> list[int]:
        """Partition of each message: keyed ones by mmh3 (failing if unavailable), unkeyed ones together by round-robin."""
        unkeyed: int | None = None
        out = []
        for key in keys:
            if key is None:
                if unkeyed is None:
                    unkeyed = self._send_rr.next(self.available)
                out.append(unkeyed)
                continue
            p = partition_for_key(key, self.partition_count)
            if not self.available(p):
                raise PartitionUnavailableError(
                    f"partition {p} of {self.name!r}, which key {key!r} maps to, is unavailable; nothing was sent"
                )
            out.append(p)
        return out

    def send(
        self,
        rows: pa.Table,
        keys: Sequence[str | None],
        expand: Expand | None = None,
        once: Fence | None = None,
        *,
        detect_duplicates: bool = True,
    ) -> pa.Table:
        """Store rows atomically in one commit (placing them by key); returns the stored rows with sequence numbers.

        On a duplicate-detecting entity, rows whose message_id the partition accepted within the
        detection window are dropped and not returned, unless `detect_duplicates` is False (dead
        letters forwarded here: accepted once already, they are never dropped, docs/semantics.md §9).
        """
        if rows.num_rows == 0:
            return rows
        parts = pa.array(self.place(keys), pa.int32())
        rows = rows.set_column(rows.schema.get_field_index(PARTITION_COLUMN), PARTITION_COLUMN, parts)
        # Stamped anew in each attempt, after it read its snapshot: a message numbered after another is never
        # stamped as enqueued before it, and no retry spends the message's time to live (docs/semantics.md §2).
        return retry_commit(
            lambda: self.table.append(rows, self.dedupe_since() if detect_duplicates else None, expand, once, _stamped_now),
            self.deadline(),
            f"send to {self.name}",
        )

    def dedupe_since(self) -> datetime | None:
        """Start of the duplicate-detection window, or None when the entity does not detect duplicates."""
        p = self.props
        if isinstance(p, SubscriptionProperties) or not p.requires_duplicate_detection:
            return None
        return utcnow() - p.duplicate_detection_history_time_window

    # ---- receive -----------------------------------------------------------------------------

    def receive(
        self, sub_queue: str, max_count: int, *, delete: bool, wait_s: float, check: Callable[[], None] | None = None
    ) -> pa.Table:
        """Take up to max_count available messages from all partitions, waiting up to wait_s for the first.

        `check` runs after each wait and raises when the entity may no longer be received from (its
        settings changed during the wait: disabled, or forwarding now); the caller checked before the first poll.

        Unavailable partitions are skipped (docs/semantics.md §10), but a receive that ends with
        nothing while every partition that may hold its messages is unavailable (`hidden_partitions`)
        raises PartitionUnavailableError naming them: damaged storage is reported, never read as empty.
        """
        give_up = time.monotonic() + wait_s
        poll = POLL_MIN_S
        while True:
            got = self._receive_once(sub_queue, max_count, delete)
            if got.num_rows:
                return got
            if time.monotonic() >= give_up:
                down = self.hidden_partitions(sub_queue)  # a pass that found damage marked its partition
                if down:
                    raise self.unavailable(down, "nothing was received")
                return got
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)
            if check is not None:
                check()

    def _receive_once(self, sub_queue: str, max_count: int, delete: bool) -> pa.Table:
        """One pass over the partitions from a rotating start, gathering until max_count."""
        start = next(self._recv_start)
        out: list[pa.Table] = []
        remaining = max_count
        dt = self.table.snapshot()  # one snapshot serves every partition this pass does not change
        stop_at = math.inf  # set by the first partition that gives messages (LOCKING_SHARE)
        for i in range(self.partition_count):
            p = (start + i) % self.partition_count
            began = time.monotonic()
            if began >= stop_at:
                break  # the first locks would have too little time left: return what this pass took
            if not self.available(p) or not self.table.holds_files(dt, p):
                continue  # an empty partition: nothing to read (a receive of one message would try most of 16)
            try:
                got = self.receive_partition(dt, p, sub_queue, remaining, delete)
            except StorageError as exc:
                if not out:
                    raise
                log.warning("receive from %s stopped at partition %d (%s): returning what it took", self.name, p, exc)
                break  # what earlier partitions gave is locked (or deleted) already: returned, never dropped
            if got.num_rows:
                if not out:  # its locks were stamped after `began`
                    stop_at = began + self.locking_time_s(delete)
                out.append(got)
                remaining -= got.num_rows
            if remaining <= 0:
                break
        return pa.concat_tables(out) if out else empty_rows()

    def hidden_partitions(self, sub_queue: str, found_down: Collection[int] = ()) -> list[int]:
        """The unavailable partitions whose files may hold messages of the sub-queue, when every such partition is
        unavailable; else []. A receive that found nothing then raises (`unavailable`) rather than read as empty.
        `found_down`: partitions other handles found unavailable (a Spark task's, a locking thread's)."""
        dt = self.table.snapshot()
        holding = [p for p in range(self.partition_count) if self.table.may_hold_messages(dt, p, sub_queue, self.subscription)]
        down = [p for p in holding if p in found_down or not self.available(p)]
        return down if down and len(down) == len(holding) else []

    def unavailable(self, partitions: Sequence[int], outcome: str) -> PartitionUnavailableError:
        """The error of an operation that could not read these partitions: each one's reason (a fault, the damage found)."""
        reasons = []
        for p in partitions:
            try:
                self.table.faults.check(p, "read")
                self.table.faults.check(p, "write")
            except PartitionUnavailableError as exc:
                reasons.append(str(exc))
            else:
                reasons.append(f"partition {p} is unavailable")  # its mark lapsed meanwhile
        shown = ", ".join(map(str, partitions))
        return PartitionUnavailableError(
            f"{outcome}: partition(s) {shown} of {self.name!r}, which may hold its messages, could not be read "
            f"({'; '.join(reasons)}); Namespace.check() (`sparkqueue check`) reports damaged storage"
        )

    def receive_partition(
        self,
        dt: Snapshot,
        p: int,
        sub_queue: str,
        limit: int,
        delete: bool,
        written: list[str] | None = None,
    ) -> pa.Table:
        """Lock (or delete) up to `limit` messages of one partition; moves on after repeated conflicts.

        Starts from the caller's snapshot and refreshes only after a conflict or its own commit
        (a commit does not advance the handle's version). The messages a commit locks go to one
        data file of their own (up to `limit` rows); `written` collects those files' paths. A file
        split by the count keeps its other rows in files of `limit` rows (a multiple of it, for a
        small count), so the next receives of that count lock whole files (docs/storage.md,
        "Receives fill their count").
        """
        if sub_queue == SUB_QUEUE_MAIN and self.route_rest_left_s(dt) > 0:
            return empty_rows()  # forwarders may still hold messages by the route before the change: wait for the rest
        out: list[pa.Table] = []
        attempt = 0
        fresh = True
        dead = False
        scan = limit  # candidates read; grows while expired or over-delivered messages stand in front
        count = max(limit, 1)
        split = min(count * -(-MIN_SPLIT_ROWS // count), MAX_FILE_ROWS)  # receive(30) leaves files of 120: 4 receives each
        while limit > 0 and attempt < LOCK_ATTEMPTS_PER_PARTITION:
            if not fresh:
                dt = self.table.snapshot()
            fresh = False
            now = utcnow()
            try:
                cands = self.table.candidates(dt, p, sub_queue, now, scan, ROW_COLUMNS, self.subscription)
            except PartitionUnavailableError:
                break
            except StorageError:
                if out:
                    break  # what earlier rounds took stands: returned, never dropped
                raise
            if cands.num_rows == 0:
                break
            cands = lifecycle.through_deliverable(cands, now, self.policy, limit)
            d = lifecycle.deliver(cands, now, self.policy, delete=delete)
            try:
                self.table.apply(
                    dt, p, d.changes, changed_file_rows=max(limit, MAX_FILE_ROWS), kept_file_rows=split, written=written
                )
            except CommitConflict:
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            except PartitionUnavailableError:
                break
            except StorageError:
                if out:
                    break  # as above; this commit's outcome is unknown, its locks lapse if it landed
                raise
            dead = dead or d.dead_lettered > 0
            if d.delivered.num_rows:
                out.append(d.delivered)
                limit -= d.delivered.num_rows
            if d.delivered.num_rows == cands.num_rows:
                break  # nothing was expired or dead-lettered: the candidates were all it would give now
            scan = min(max(scan, limit) * EXPIRY_SCAN_GROWTH, max(limit, MAX_EXPIRY_SCAN))  # a few commits clear a long run
        if dead:
            self.dead_lettered([p])
        # In order: a later round may take an earlier message (abandoned, or its lock lapsed, meanwhile).
        return in_sequence(pa.concat_tables(out)) if out else empty_rows()

    def receive_deferred(self, sub_queue: str, seqs: Sequence[int], *, delete: bool) -> pa.Table:
        """Lock (or delete) the deferred messages with these sequence numbers; others are skipped."""
        if sub_queue == SUB_QUEUE_MAIN:
            self.wait_route_rest()  # a forwarder by the route before a change may still move them (docs/semantics.md §9)
        out = []
        dead: list[int] = []  # partitions where a delivery count dead-lettered a message instead
        for p, group in _by_partition(seqs).items():

            def attempt(p: int = p, group: list[int] = group) -> pa.Table:
                dt = self.table.snapshot()
                now = utcnow()
                rows = self.table.rows_by_sequence(dt, p, group, ROW_COLUMNS, self.subscription)
                lock_free = pc.or_kleene(
                    pc.is_null(rows.column("locked_until_utc")),
                    pc.less_equal(rows.column("locked_until_utc"), pa.scalar(now, TIMESTAMP)),
                )
                mask = pc.and_(
                    pc.and_(pc.equal(rows.column("state"), STATE_DEFERRED), pc.equal(rows.column("sub_queue"), sub_queue)),
                    pc.and_(lock_free, self.owns(rows)),
                )
                rows = rows.filter(mask)
                if rows.num_rows == 0:
                    return rows
                d = lifecycle.deliver(rows, now, self.policy, delete=delete)
                self.table.apply(dt, p, d.changes)
                if d.dead_lettered:
                    dead.append(p)
                return d.delivered

            out.append(retry_commit(attempt, self.deadline(), f"receive deferred from {self.name}"))
        self.dead_lettered(sorted(set(dead)))
        return pa.concat_tables(out) if out else empty_rows()

    # ---- settle ------------------------------------------------------------------------------

    def settle(
        self,
        sub_queue: str,
        items: Sequence[tuple[int, str]],
        op: str,
        reason: lifecycle.Texts = None,
        description: lifecycle.Texts = None,
    ) -> SettleResult:
        """Settle (sequence_number, lock_token) pairs of `sub_queue`; an item whose lock is not current is reported, not applied.

        A dead letter's reason and description are one text, or a list with one per item.
        """
        seqs, tokens = item_arrays(items)
        parts = pc.shift_right(seqs, SEQUENCE_BITS).to_numpy()
        ok = np.zeros(len(items), bool)
        until: list[datetime | None] = [None] * len(items)
        for p in dict.fromkeys(parts.tolist()):  # partitions in the order of their first item
            if not self.available(p):
                raise PartitionUnavailableError(f"partition {p} of {self.name!r} is unavailable; the settlement was not applied")
            idx = np.flatnonzero(parts == p)

            def attempt(p: int = p, idx: np.ndarray = idx) -> None:
                dt = self.table.snapshot()
                now = utcnow()
                take = pa.array(idx)
                good, valid = self.locked_rows(dt, p, sub_queue, seqs.take(take), tokens.take(take), now)
                held = idx[valid].tolist()  # the items of `good`, in its order
                if good.num_rows:
                    texts = lifecycle.texts_of(reason, held), lifecycle.texts_of(description, held)
                    self.table.apply(dt, p, lifecycle.settle(good, op, now, self.policy, *texts))
                ok[idx] = valid
                if op == lifecycle.RENEW:
                    for i in held:
                        until[i] = now + self.policy.lock_duration

            retry_commit(attempt, self.deadline(), f"{op} on {self.name}")
        return SettleResult(ok.tolist(), until)

    def locked_rows(
        self, dt: Snapshot, p: int, sub_queue: str, seqs: pa.Array, tokens: pa.Array, now: datetime
    ) -> tuple[pa.Table, np.ndarray]:
        """Rows of one partition and sub-queue whose lock the items (`seqs[i]`, `tokens[i]`) hold now, and a per-item verdict.

        The rows come in item order, one per item whose lock holds (an item given twice, twice). A
        row of the other sub-queue counts as not held: the dead-letter sub-queue is an entity of its own.
        """
        rows = self.table.rows_by_sequence(dt, p, seqs, STATE_COLUMNS, self.subscription)
        rows = keep_rows(rows, pc.and_(self.owns(rows), pc.equal(rows.column("sub_queue"), sub_queue)))
        at = index_of(seqs, rows.column("sequence_number"))  # each item's row; null where it has none
        present = pc.is_valid(at).to_numpy(zero_copy_only=False)
        cur = rows.take(at.drop_null())
        held = np.asarray(lifecycle.lock_valid(cur, tokens.filter(pa.array(present)), now), bool)
        valid = np.zeros(len(seqs), bool)
        valid[np.flatnonzero(present)] = held
        return keep_rows(cur, pa.array(held, pa.bool_())), valid

    def owns(self, rows: pa.Table) -> pa.ChunkedArray:
        """Mask of the rows that belong to this entity (its subscription, in a topic's table)."""
        sub = rows.column("subscription")
        if self.subscription == ANY_SUBSCRIPTION:
            return pc.is_valid(rows.column("sequence_number"))
        return pc.is_null(sub) if self.subscription is None else pc.fill_null(pc.equal(sub, self.subscription), False)

    def transact(
        self, partition: int, new_rows: pa.Table | None, settles: Sequence[PendingSettle], expand: Expand | None = None
    ) -> pa.Table | None:
        """Commit sends and settlements of one partition atomically (a transaction); all or nothing.

        Raises MessageLockLostError, applying nothing, when any settled message's lock is not current.
        """
        if not self.available(partition):
            raise PartitionUnavailableError(
                f"partition {partition} of {self.name!r} is unavailable; the transaction was not applied"
            )
        if new_rows is not None and new_rows.num_rows:
            new_rows = new_rows.set_column(
                new_rows.schema.get_field_index(PARTITION_COLUMN),
                PARTITION_COLUMN,
                constant(partition, pa.int32(), new_rows.num_rows),
            )

        def attempt() -> pa.Table | None:
            dt = self.table.snapshot()
            now = utcnow()
            sent = enqueued_at(new_rows, now) if new_rows is not None else None  # the sends take effect now
            parts = []
            for st in settles:
                touch = st.guard(dt, partition, now) if st.guard is not None else None  # SessionLockLostError
                if touch is not None and touch.num_rows:
                    parts.append(touch)
                good, valid = self.locked_rows(dt, partition, st.sub_queue, *item_arrays(st.items), now)
                if not valid.all():
                    raise MessageLockLostError(
                        "a message settled in the transaction lost its lock (expired or superseded); nothing was applied"
                    )
                every = range(len(st.items))  # all held, so `good` holds every item, in order
                texts = lifecycle.texts_of(st.reason, every), lifecycle.texts_of(st.description, every)
                parts.append(lifecycle.settle(good, st.op, now, self.policy, *texts))
            changes = pa.concat_tables(parts) if parts else empty_changes()
            return self.table.apply(dt, partition, changes, sent, self.dedupe_since(), expand)

        return retry_commit(attempt, self.deadline(), f"transaction on {self.name}")

    def cancel_scheduled(self, seqs: Sequence[int]) -> int:
        """Remove scheduled (not yet visible, unlocked) messages; returns how many rows were removed.

        On a topic a number names a message: every subscription's copy of it goes (topic_copies).
        """
        removed = 0
        for p, group in _by_partition(seqs).items():

            def attempt(p: int = p, group: list[int] = group) -> int:
                dt = self.table.snapshot()
                if self.subscription == ANY_SUBSCRIPTION:
                    group = sorted({c for seq in group for c in self.topic_copies(dt, p, seq)})
                rows = self.table.rows_by_sequence(dt, p, group, STATE_COLUMNS, self.subscription)
                rows = rows.filter(self.owns(rows))
                mask = lifecycle.scheduled_rows(rows, utcnow())  # a dead letter with its time ahead is no scheduled message
                rows = rows.filter(pc.and_(mask, pc.is_null(rows.column("lock_token"))))
                if rows.num_rows:
                    self.table.apply(dt, p, lifecycle.changes(rows, lifecycle.removal(self.policy)))
                return int(rows.num_rows)

            removed += retry_commit(attempt, self.deadline(), f"cancel scheduled on {self.name}")
        return removed

    def topic_copies(self, dt: Snapshot, p: int, seq: int) -> list[int]:
        """Numbers of every copy of the topic message whose copy is numbered `seq` ([] when none is live).

        A message's copies are the run of consecutive copies sharing its id and enqueue time
        (docs/semantics.md §5), read in a window around `seq` that widens on a side only while the
        run reaches that side's edge and the partition goes on beyond it.
        """
        first = sequence_number(p, 0)
        top = sequence_number(p, dt.transaction_version(fence_app_id(p)) or 0)  # the partition's newest number
        below = above = COPY_WINDOW
        while True:
            lo, hi = max(seq - below, first), min(seq + above, top)
            rows = live_copies(self.table.rows_between(dt, p, lo, hi, ["kind", "state", "subscription", *COPY_KEY]))
            run = copy_run(rows, seq)
            if run is None:
                return []
            i, j = run
            open_below, open_above = i == 0 and lo > first, j == rows.num_rows and hi < top
            if not (open_below or open_above):
                copies: list[int] = rows.column("sequence_number").to_pylist()[i:j]
                return copies
            below, above = below * (8 if open_below else 1), above * (8 if open_above else 1)

    # ---- browse and count ----------------------------------------------------------------------

    def peek(self, sub_queue: str, cursors: dict[int, int], max_count: int) -> pa.Table:
        """Up to max_count messages, in sequence order per partition, from each partition's cursor; advances cursors.

        A browse never skips messages: a partition it must read (one with files at or after its
        cursor, before the count is reached) that is unavailable, or that this read finds damaged,
        raises PartitionUnavailableError, and the cursors stay where they were.
        """
        dt = self.table.snapshot()
        out = []
        moved: dict[int, int] = {}
        remaining = max_count
        for p in range(self.partition_count):
            if remaining <= 0:
                break
            if not self.table.may_hold_messages(dt, p, sub_queue, self.subscription, from_seq=cursors.get(p)):
                continue  # browsed to its end already, or none of its files holds this browse's messages
            rows = self._peek_partition(dt, p, cursors.get(p))
            rows = rows.filter(pc.equal(rows.column("sub_queue"), sub_queue)).slice(0, remaining)
            if rows.num_rows:
                out.append(rows.select(ROW_COLUMNS))
                remaining -= rows.num_rows
                moved[p] = rows.column("sequence_number")[-1].as_py() + 1
        cursors.update(moved)
        return pa.concat_tables(out) if out else empty_rows()

    def _peek_partition(self, dt: Snapshot, p: int, from_seq: int | None) -> pa.Table:
        """A partition's rows from `from_seq` for a browse; PartitionUnavailableError when it is down or found damaged."""
        try:
            return self.table.scan(dt, p, ROW_COLUMNS, from_seq=from_seq, subscription=self.subscription)
        except PartitionUnavailableError:
            if not self.available(p):
                raise self.unavailable([p], "nothing was browsed") from None
        # Still available: a file was replaced under this read (a compaction, then a vacuum). Read it again, as of now.
        try:
            return self.table.scan(self.table.snapshot(), p, ROW_COLUMNS, from_seq=from_seq, subscription=self.subscription)
        except PartitionUnavailableError:
            if not self.available(p):
                raise self.unavailable([p], "nothing was browsed") from None
            raise

    def runtime_properties(self, subscriptions: Collection[str] | None = None) -> RuntimeProperties:
        """Counts per partition and in total; unavailable partitions count as 'Limited'.

        A topic passes its live subscriptions' keys: a deleted subscription's rows stay until maintenance drops them.
        """
        keep = None if subscriptions is None else pa.array(sorted(subscriptions), pa.string())
        dt = self.table.snapshot()
        now = utcnow()
        parts = []
        for p in range(self.partition_count):
            info = PartitionRuntimeProperties(partition_id=p, available=self.available(p))
            if info.available:
                try:
                    rows = self.table.scan(
                        dt, p, ["sub_queue", "state", "scheduled_enqueue_time_utc"], subscription=self.subscription
                    )
                except PartitionUnavailableError:  # damage found by this very read: reported as the partition's status
                    info.available = False
                else:
                    _count_into(info, rows if keep is None else rows.filter(pc.is_in(rows.column("subscription"), keep)), now)
                    info.size_in_bytes = self.table.partition_bytes(dt, p)
            parts.append(info)
        return RuntimeProperties.aggregate(self.name, parts)


def _stamped_now(rows: pa.Table) -> pa.Table:
    """Message rows stamped as enqueued now (a send attempt's stamp)."""
    return enqueued_at(rows, utcnow())


def enqueued_at(rows: pa.Table, now: datetime) -> pa.Table:
    """Message rows made earlier, stamped as a send `now` stores them (message.message_rows): enqueue, visibility, expiry."""
    visible = limits.visible_at(rows.column("scheduled_enqueue_time_utc"), now)
    expires = limits.expiries(visible, rows.column("time_to_live_ms"))
    return with_columns(rows, enqueued_time_utc=visible, available_at_utc=visible, expires_at_utc=expires)


def _count_into(info: PartitionRuntimeProperties, rows: pa.Table, now: datetime) -> None:
    """Fill a partition's non-overlapping counts from its live message rows."""
    dlq = pc.equal(rows.column("sub_queue"), SUB_QUEUE_DEAD_LETTER)
    main = rows.filter(pc.invert(dlq))
    deferred = pc.equal(main.column("state"), STATE_DEFERRED)
    scheduled = lifecycle.scheduled_rows(main, now)
    info.dead_letter_message_count = pc.sum(dlq).as_py() or 0
    info.deferred_message_count = pc.sum(deferred).as_py() or 0
    info.scheduled_message_count = pc.sum(scheduled).as_py() or 0
    info.active_message_count = main.num_rows - info.deferred_message_count - info.scheduled_message_count
    info.total_message_count = rows.num_rows


def _by_partition(seqs: Iterable[int]) -> dict[int, list[int]]:
    """Group sequence numbers by the partition in their top bits."""
    out: dict[int, list[int]] = defaultdict(list)
    for s in seqs:
        out[partition_of(int(s))].append(int(s))
    return out


_EMPTY_ROWS = pa.schema([ENTITY_SCHEMA.field(c) for c in ROW_COLUMNS]).empty_table()


def empty_rows() -> pa.Table:
    """A row table with no rows (shared: Arrow tables are immutable)."""
    return _EMPTY_ROWS


__all__ = ["Entity", "SettleResult", "partition_of", "utcnow", "SEQUENCE_MASK", "SUB_QUEUE_MAIN"]
