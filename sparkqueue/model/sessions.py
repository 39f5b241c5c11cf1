"""Sessions (docs/semantics.md §6): an exclusive, expiring lock per session id, FIFO delivery within it, and session state.

Each session has one row (kind "session") in its partition holding the session lock and the
state (in `body`). Every session operation rewrites that row in the same commit as its own
changes ("touch"), so an operation racing a receiver that took the session over always fails
its commit and then sees the lost lock, never acting on a session it no longer holds.

Speed (docs/storage.md, "Sessions keep together"): every commit writes a session's rows to a
file of its own and opens only files whose statistics may hold the session, so a session cycle
costs two small commits, the accept (row locked, with a prefetch_count its first messages
delivered) and the completion, and a log-only one: closing a session left with no state and no
messages deletes its row, by then alone in its file. The holder keeps a drained session until it
closes or its lock expires (docs/semantics.md §6). Next-available accepts pick sessions from
file statistics at random among a partition's oldest few, and number a new row from one of the
session's messages instead of the partition's sequence fence, so receivers accepting different
sessions of one partition do not conflict.
"""

from __future__ import annotations

import bisect
import builtins
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import (
    InvalidOperationError,
    OperationTimeoutError,
    PartitionUnavailableError,
    SessionCannotBeLockedError,
    SessionLockLostError,
)
from sparkqueue.model import lifecycle
from sparkqueue.model.entity import POLL_MAX_S, POLL_MIN_S, ROW_COLUMNS, Entity, Guard, SettleResult, empty_rows, utcnow
from sparkqueue.model.ids import new_ids
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.storage.files import MAX_FILE_ROWS
from sparkqueue.storage.index import FileInfo
from sparkqueue.storage.log import CommitConflict, Snapshot
from sparkqueue.storage.retry import retry_commit
from sparkqueue.storage.schema import (
    ENTITY_SCHEMA,
    KIND_MESSAGE,
    KIND_SESSION,
    PARTITION_COLUMN,
    STATE_ACTIVE,
    STATE_COMPLETED,
    STATE_DEFERRED,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    keep_rows,
    member_of,
    with_columns,
)
from sparkqueue.storage.table import MUTABLE_COLUMNS, OP_DELETE, OP_SET, OP_SET_BODY, empty_changes, partition_of

log = logging.getLogger(__name__)

# Rewrites of a session entity's files write each session's rows to files of their own
# (docs/storage.md), so one session's accept and completion never rewrite another session's rows.
GROUP_COLUMN = "session_id"
KEEP_TOGETHER = MAX_FILE_ROWS  # message rows an accept moves into its session's file (one full file)
SPREAD = 4  # a next-available accept picks at random among this many of a partition's oldest free sessions
# A session row made in a commit that also rewrites one of the session's messages takes that message's sequence
# number with this counter bit set: unique in the partition, and made without the partition's sequence fence.
ROW_BIT = 1 << 47


@dataclass
class SessionLock:
    """A receiver's hold on one session."""

    session_id: str
    partition: int
    token: str
    locked_until: datetime
    # Set for good by `Sessions.release` (the receiver closed): every later operation under the lock raises
    # SessionLockLostError.
    released: bool = False
    # Serializes this process's commits under the lock with its release: a renewal (AutoLockRenewer thread) racing
    # close either commits before the release reads the row (which then releases what it made) or sees `released`.
    mutex: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


@dataclass(frozen=True)
class SessionInfo:
    """A session as listed: its state, lock expiry (None when free) and message counts."""

    session_id: str
    state: bytes | None
    locked_until_utc: datetime | None
    active_message_count: int
    deferred_message_count: int


class Sessions:
    """Session operations over one session-enabled queue or subscription."""

    def __init__(self, entity: Entity) -> None:
        self.entity = entity
        self.table = entity.table
        self._start = itertools.count(random.randrange(entity.partition_count))

    # ---- accept ------------------------------------------------------------------------------

    def accept(
        self,
        session_id: str | None,
        wait_s: float,
        *,
        prefetch: int = 0,
        delete: bool = False,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[SessionLock, pa.Table]:
        """Lock a named session, or (session_id None) the next session with available messages.

        The same commit also delivers the session's first `prefetch` messages (returned with the
        lock), so accepting and receiving the head of a session is one commit. With no free session
        within `wait_s`, NEXT_AVAILABLE_SESSION raises OperationTimeoutError (the SDK's session-pool
        loop ends on it); a named session held elsewhere raises SessionCannotBeLockedError. When
        every partition whose files may hold messages was unavailable, the wait ends with
        PartitionUnavailableError instead: damaged storage is not read as "no session" (docs/semantics.md §10).
        `exclude`: sessions NEXT_AVAILABLE_SESSION passes over (a caller's own, whose locks may lapse).
        """
        # Forwarders by the route before a forward_to change may still move the entity's messages (docs/semantics.md §9).
        if session_id is not None:
            self.entity.wait_route_rest()
            return retry_commit(
                lambda: self._accept_named(session_id, prefetch, delete), self.entity.deadline(), f"accept session {session_id!r}"
            )
        give_up = time.monotonic() + wait_s
        poll = POLL_MIN_S
        while True:
            got = self._accept_next(prefetch, delete, exclude) if self.entity.route_rest_left_s() <= 0 else None
            if got is not None:
                return got
            if time.monotonic() >= give_up:
                down = self.entity.hidden_partitions(SUB_QUEUE_MAIN)
                if down:
                    raise self.entity.unavailable(down, "no session was accepted")
                raise OperationTimeoutError(
                    f"no session of {self.entity.name!r} with available messages could be locked within {wait_s:g}s"
                )
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)

    def _accept_named(
        self, session_id: str, prefetch: int, delete: bool, *, need_messages: bool = False, dt: Snapshot | None = None
    ) -> tuple[SessionLock, pa.Table]:
        """One attempt to lock a session and deliver its head; SessionCannotBeLockedError when another receiver holds it.

        One commit: the session row takes the new lock, message locks left by an earlier holder
        are cleared (the new holder starts from the earliest message), the first `prefetch`
        messages are delivered, and every message row of the session is written to one file of
        its own (docs/storage.md: a session's rows kept together), so its completion drops that file whole.
        """
        p = partition_for_key(session_id, self.entity.partition_count)
        dt = dt or self.table.snapshot()
        now = utcnow()
        row, rows = self._read(dt, p, session_id)
        if row is not None:
            held = row.column("locked_until_utc")[0].as_py()
            if row.column("lock_token")[0].as_py() is not None and held is not None and held > now:
                raise SessionCannotBeLockedError(f"session {session_id!r} is locked by another receiver until {held.isoformat()}")
        token = new_ids(1)[0]
        until = now + self.entity.policy.lock_duration
        lock = SessionLock(session_id, p, token, until)
        stale = _held(rows)
        together = pa.array(np.arange(rows.num_rows) < KEEP_TOGETHER)
        rows = _cleared(rows, now)  # an earlier holder's message locks end with its lock
        available = _next_messages(rows, now)
        if need_messages and available.num_rows == 0:
            raise SessionCannotBeLockedError(f"session {session_id!r} has no available message any more")  # drained meanwhile
        # The head comes from all of the session's rows: an abandoned message may sit behind KEEP_TOGETHER rows
        # (dead letters, deferred, scheduled) while the earlier holder's later messages are among the stale ones.
        policy = self.entity.policy
        head = lifecycle.through_deliverable(available, now, policy, prefetch) if prefetch > 0 else empty_rows()
        rows = rows.filter(pc.or_(pc.or_(stale, together), _picked(rows, head)))
        delivered = empty_rows()
        parts: list[pa.Table] = []
        dead = 0
        if head.num_rows:
            d = lifecycle.deliver(head, now, self.entity.policy, delete=delete)
            dead = d.dead_lettered
            delivered = _session_until(d.delivered, until)
            parts.append(_session_until_changes(d.changes, until))
            rows = rows.filter(pc.invert(_picked(rows, head)))
        if rows.num_rows:
            parts.append(lifecycle.changes(rows, OP_SET))  # unchanged rows move along: the session stays together
        if row is None:
            changes = pa.concat_tables(parts) if parts else empty_changes()
            new_row = self._new_row(session_id, p, now, token, until)
            self._apply(dt, p, session_id, changes, new_row, anchor=_first_seq(changes))
        else:
            parts.insert(0, lifecycle.changes(row, OP_SET, lock_token=token, locked_until_utc=until))
            self._apply(dt, p, session_id, pa.concat_tables(parts))
        if dead:
            self.entity.dead_lettered([p])
        return lock, delivered

    def _accept_next(
        self, prefetch: int, delete: bool, exclude: frozenset[str] = frozenset()
    ) -> tuple[SessionLock, pa.Table] | None:
        """Lock a free session that has an available message, trying partitions from a rotating start.

        A session's rows live in files of their own (docs/storage.md), so most candidates are read
        off file statistics without opening a file: a one-session file with a message available
        now. Files that mix sessions (fresh sends) are read as before. Among the candidates one of
        the first few is picked at random, so receivers racing over one partition mostly lock
        different sessions instead of colliding.
        """
        start = next(self._start)
        for i in range(self.entity.partition_count):
            p = (start + i) % self.entity.partition_count
            if not self.entity.available(p):
                continue
            try:
                got = self._accept_in(p, prefetch, delete, exclude)
            except PartitionUnavailableError as exc:  # damage this pass found: skip it, as receives do (the caller reports)
                log.warning("session accept on %s skipped partition %d: %s", self.entity.name, p, exc)
                continue
            if got is not None:
                return got
        return None

    def _accept_in(self, p: int, prefetch: int, delete: bool, exclude: frozenset[str]) -> tuple[SessionLock, pa.Table] | None:
        """Lock a free session of partition p that has an available message, if there is one (see _accept_next)."""
        dt = self.table.snapshot()
        seen: set[str] = set(exclude)
        got = self._try_sessions(dt, p, self._free_by_stats(dt, p), seen, prefetch, delete)
        if got is not None:
            return got
        window = 64
        while True:
            now = utcnow()
            cands = self.table.candidates(dt, p, SUB_QUEUE_MAIN, now, window, subscription=self.entity.subscription)
            got = self._try_sessions(dt, p, cands.column("session_id").to_pylist(), seen, prefetch, delete)
            if got is not None:
                return got
            if cands.num_rows < window:
                return None
            window *= 4  # every session in the window is held: a free one may wait further back

    def _free_by_stats(self, dt: Snapshot, p: int) -> list[str]:
        """Sessions of the partition that, by file statistics alone, have a message available now (oldest first)."""
        now = utcnow()
        sub = self.entity.subscription
        return [
            f.min_session
            for f in self.table.files(dt, p)
            if f.min_session is not None
            and f.min_session == f.max_session
            and f.min_available_at is not None
            and f.min_available_at <= now
            and f.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, sub)
        ]

    def _try_sessions(
        self, dt: Snapshot, p: int, sids: Sequence[str | None], seen: set[str], prefetch: int, delete: bool
    ) -> tuple[SessionLock, pa.Table] | None:
        """Try to lock one of these sessions (each at most once per pass), picking at random among the first SPREAD."""
        todo = [s for s in dict.fromkeys(sids) if s is not None and s not in seen]
        while todo:
            sid = todo.pop(random.randrange(min(len(todo), SPREAD)))
            seen.add(sid)
            try:
                return self._accept_named(sid, prefetch, delete, need_messages=True, dt=dt)
            except (SessionCannotBeLockedError, CommitConflict):
                dt = self.table.snapshot()
        return None

    # ---- receive and settle --------------------------------------------------------------------

    def receive(self, lock: SessionLock, max_count: int, *, delete: bool, wait_s: float) -> pa.Table:
        """The session's next messages in sequence order, after those already delivered under this lock.

        The holder may receive further messages before settling earlier ones; an abandoned
        message (its lock cleared) is the earliest undelivered one again, so it comes back first.
        """
        give_up = time.monotonic() + wait_s
        poll = POLL_MIN_S
        while True:
            got = retry_commit(lambda: self._receive_once(lock, max_count, delete), self.entity.deadline(), "session receive")
            if got.num_rows or time.monotonic() >= give_up:
                return got
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)

    def _receive_once(self, lock: SessionLock, max_count: int, delete: bool) -> pa.Table:
        with lock.mutex:  # never after the release (see SessionLock.mutex)
            return self._receive_locked(lock, max_count, delete)

    def _receive_locked(self, lock: SessionLock, max_count: int, delete: bool) -> pa.Table:
        dt = self.table.snapshot()
        if self.entity.route_rest_left_s(dt) > 0:
            return empty_rows()  # as Entity.receive_partition: a forward_to change is settling (docs/semantics.md §9)
        now = utcnow()
        row, head = self._head(dt, lock.partition, lock.session_id, now, max_count)
        touch = self._touch(self._check(row, lock, now))
        if head.num_rows == 0:
            return empty_rows()
        d = lifecycle.deliver(head, now, self.entity.policy, delete=delete)
        changes = _session_until_changes(d.changes, lock.locked_until)
        self._apply(dt, lock.partition, lock.session_id, pa.concat_tables([changes, touch]))
        if d.dead_lettered:
            self.entity.dead_lettered([lock.partition])
        return _session_until(d.delivered, lock.locked_until)

    def guard(self, lock: SessionLock) -> Guard:
        """A check run inside each commit: the session lock must still be ours; returns the row's touch."""

        def check(dt: Snapshot, partition: int, now: datetime) -> pa.Table:
            return self._touch(self._hold(dt, lock, now))

        return check

    def settle(
        self,
        lock: SessionLock,
        items: Sequence[tuple[int, str]],
        op: str,
        reason: lifecycle.Texts = None,
        description: lifecycle.Texts = None,
    ) -> SettleResult:
        """Settle the held session's (sequence_number, lock_token) items in one commit, with the session lock check.

        Like Entity.settle, but reading and rewriting only the session's own file(s): a session's
        messages interleave by sequence number with other sessions', so a settlement found by
        sequence range would open every file of the partition. An item that is not a current
        delivery of this session is reported, not applied; a lost session lock raises SessionLockLostError.
        A completion that drains the session keeps it held (docs/semantics.md §6).
        """
        ok = [False] * len(items)

        def attempt() -> None:
            with lock.mutex:  # never after the release (see SessionLock.mutex)
                settle_once()

        def settle_once() -> None:
            dt = self.table.snapshot()
            now = utcnow()
            row, rows = self._read(dt, lock.partition, lock.session_id, self._files_with(dt, lock, [seq for seq, _ in items]))
            row = self._check(row, lock, now)
            # The session's dead letters are another entity's (its dead-letter sub-queue): never settled here.
            main = zip(rows.column("sequence_number").to_pylist(), rows.column("sub_queue").to_pylist(), strict=True)
            by_seq = {s: j for j, (s, q) in enumerate(main) if q == SUB_QUEUE_MAIN}
            present = [k for k, (seq, _) in enumerate(items) if seq in by_seq]
            cur = rows.take(pa.array([by_seq[items[k][0]] for k in present], pa.int64()))
            held = lifecycle.lock_valid(cur, [items[k][1] for k in present], now)
            good = cur.filter(pa.array(held, pa.bool_()))
            parts = self._touch(row)  # the touch: a takeover racing this commit makes it conflict
            if good.num_rows:
                kept = [k for k, h in zip(present, held, strict=True) if h]  # the items of `good`, in its order
                texts = lifecycle.texts_of(reason, kept), lifecycle.texts_of(description, kept)
                parts = pa.concat_tables([parts, lifecycle.settle(good, op, now, self.entity.policy, *texts)])
            self._apply(dt, lock.partition, lock.session_id, parts)
            for k, v in zip(present, held, strict=True):
                ok[k] = v

        retry_commit(attempt, self.entity.deadline(), f"{op} on session {lock.session_id!r} of {self.entity.name}")
        return SettleResult(ok, [None] * len(items))

    def receive_deferred(self, lock: SessionLock, seqs: list[int], *, delete: bool) -> pa.Table:
        """The held session's deferred messages with these sequence numbers; other sessions' are never returned."""
        self.entity.wait_route_rest()  # as Entity.receive_deferred
        mine = [s for s in seqs if partition_of(s) == lock.partition]

        def attempt() -> pa.Table:
            with lock.mutex:  # never after the release (see SessionLock.mutex)
                return deferred_once()

        def deferred_once() -> pa.Table:
            dt = self.table.snapshot()
            now = utcnow()
            touch = self._touch(self._hold(dt, lock, now))  # raises SessionLockLostError when the lock is gone
            if not mine:
                return empty_rows()
            rows = self.table.rows_by_sequence(dt, lock.partition, mine, ROW_COLUMNS, self.entity.subscription)
            until = rows.column("locked_until_utc")
            lock_free = pc.or_kleene(pc.is_null(until), pc.less_equal(until, pa.scalar(now, TIMESTAMP)))
            in_session = pc.fill_null(pc.equal(rows.column("session_id"), lock.session_id), False)
            ours = pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), in_session)
            deferred = pc.and_(pc.equal(rows.column("state"), STATE_DEFERRED), pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN))
            rows = rows.filter(pc.and_(pc.and_(deferred, lock_free), pc.and_(ours, self.entity.owns(rows))))
            if rows.num_rows == 0:
                return empty_rows()
            d = lifecycle.deliver(rows, now, self.entity.policy, delete=delete)
            changes = _session_until_changes(d.changes, lock.locked_until)
            self._apply(dt, lock.partition, lock.session_id, pa.concat_tables([changes, touch]))
            if d.dead_lettered:
                self.entity.dead_lettered([lock.partition])
            return _session_until(d.delivered, lock.locked_until)

        return retry_commit(attempt, self.entity.deadline(), "receive deferred session messages")

    # ---- lock and state ------------------------------------------------------------------------

    def renew(self, lock: SessionLock) -> datetime:
        """Extend the session lock by lock_duration, and with it the locks of the messages delivered under it."""

        def attempt() -> datetime:
            with lock.mutex:  # a renewal racing the release never makes the row again after it (see SessionLock.mutex)
                return renew_once()

        def renew_once() -> datetime:
            dt = self.table.snapshot()
            now = utcnow()
            row = self._hold(dt, lock, now)
            until = now + self.entity.policy.lock_duration
            rows = self._locked_messages(dt, lock)
            changes = [self._touch(row, until=until)]
            if rows.num_rows:
                changes.append(_session_until_changes(lifecycle.changes(rows, OP_SET), until))
            self._apply(dt, lock.partition, lock.session_id, pa.concat_tables(changes))
            lock.locked_until = until  # under the mutex: a receive right after stamps its messages with the new expiry
            return until

        return retry_commit(attempt, self.entity.deadline(), "renew session lock")

    def get_state(self, lock: SessionLock) -> bytes | None:
        """The session state stored with the session."""
        row = self._hold(self.table.snapshot(), lock, utcnow())
        state: bytes | None = row.column("body")[0].as_py()
        return state

    def set_state(self, lock: SessionLock, state: bytes | None) -> None:
        """Replace (or clear, with None) the session state, in one commit with the session lock check."""

        def attempt() -> None:
            with lock.mutex:  # never after the release (see SessionLock.mutex)
                set_once()

        def set_once() -> None:
            dt = self.table.snapshot()
            now = utcnow()
            changes = self._touch(self._hold(dt, lock, now), OP_SET_BODY, body=state)
            self._apply(dt, lock.partition, lock.session_id, changes)

        retry_commit(attempt, self.entity.deadline(), "set session state")

    def release(self, lock: SessionLock, undelivered: Sequence[int] = ()) -> None:
        """Give the session up at once, releasing its locked messages too; a lost lock is left alone.

        `undelivered` are messages locked for the receiver but never handed to the application
        (prefetched with the accept): their delivery count is restored. A session left with no
        state and no messages is forgotten (its row deleted), so finished sessions do not pile up;
        accepting it again starts afresh.

        The lock is released for good first: every later operation under it raises
        SessionLockLostError, and an operation of another thread (a renewal) either committed
        before this reads the row, or never commits.
        """
        with lock.mutex:
            lock.released = True

        def attempt() -> None:
            dt = self.table.snapshot()
            now = utcnow()
            try:
                row = self._check(self._row(dt, lock.partition, lock.session_id), lock, now, releasing=True)
            except SessionLockLostError:
                return
            sub = self.entity.subscription
            rows = self.table.scan(dt, lock.partition, ROW_COLUMNS, subscription=sub, session_id=lock.session_id)
            if row.column("body")[0].as_py() is None and not rows.num_rows:
                self._apply(dt, lock.partition, lock.session_id, lifecycle.changes(row, OP_DELETE))
                return
            locked = rows.filter(_held(rows))
            unused = member_of(locked.column("sequence_number"), pa.array(list(undelivered), pa.int64()))
            parts = [lifecycle.changes(row, OP_SET, lock_token=None, locked_until_utc=None)]
            for mask, op in ((unused, lifecycle.RELEASE), (pc.invert(unused), lifecycle.ABANDON)):
                some = locked.filter(mask)
                if some.num_rows:
                    parts.append(lifecycle.settle(some, op, now, self.entity.policy))
            self._apply(dt, lock.partition, lock.session_id, pa.concat_tables(parts))

        retry_commit(attempt, self.entity.deadline(), "release session")

    def peek(self, lock: SessionLock, from_seq: int | None, max_count: int) -> pa.Table:
        """Up to max_count of the held session's messages (main sub-queue) from `from_seq`, in sequence order.

        SessionLockLostError once the lock is lost, as in the SDK: the session's row comes from the same
        read of its files as its messages, so the check costs nothing more.
        """
        row, rows = self._read(self.table.snapshot(), lock.partition, lock.session_id)
        self._check(row, lock, utcnow())
        mask = pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)
        if from_seq is not None:
            mask = pc.and_(mask, pc.greater_equal(rows.column("sequence_number"), from_seq))
        return rows.filter(mask).slice(0, max_count).select(ROW_COLUMNS)

    def check(self, lock: SessionLock) -> None:
        """SessionLockLostError unless `lock` still holds its session."""
        self._hold(self.table.snapshot(), lock, utcnow())

    def list(self) -> list[SessionInfo]:
        """Every session that has a session row or messages, with its state and counts.

        The counts do not overlap, as runtime properties' (docs/semantics.md §1): active excludes
        deferred and scheduled messages, and scheduled ones are not counted.
        """
        if not getattr(self.entity.props, "requires_session", False):
            raise InvalidOperationError(f"{self.entity.name!r} does not require sessions: it has no sessions to list")
        out: dict[str, SessionInfo] = {}
        now = utcnow()
        dt = self.table.snapshot()
        down = [p for p in range(self.entity.partition_count) if not self.entity.available(p)]
        if down:  # a listing that left a partition out would read its sessions as gone (docs/semantics.md §10)
            raise self.entity.unavailable(down, "the sessions were not listed")
        for p in range(self.entity.partition_count):
            sub = self.entity.subscription
            cols = ["sub_queue", "session_id", "state", "scheduled_enqueue_time_utc"]
            msgs = self.table.scan(dt, p, cols, subscription=sub)
            main = pc.and_(pc.equal(msgs.column("sub_queue"), SUB_QUEUE_MAIN), pc.is_valid(msgs.column("session_id")))
            msgs = msgs.filter(pc.and_(main, pc.invert(lifecycle.scheduled_rows(msgs, now))))
            counts: dict[str, list[int]] = {}
            for sid, state in zip(msgs.column("session_id").to_pylist(), msgs.column("state").to_pylist(), strict=True):
                c = counts.setdefault(sid, [0, 0])
                c[0 if state == STATE_ACTIVE else 1] += 1
            rows = self.table.scan(dt, p, ["body", "locked_until_utc", "lock_token"], subscription=sub, kind=KIND_SESSION)
            state = {r["session_id"]: r for r in rows.to_pylist()}
            for sid in sorted(set(counts) | set(state)):
                r = state.get(sid, {})
                until = r.get("locked_until_utc")
                held = until if until is not None and until > now and r.get("lock_token") else None
                c = counts.get(sid, [0, 0])
                if c == [0, 0] and r.get("body") is None and held is None:
                    continue  # a finished session whose holder never released it (killed): nothing to show
                out[sid] = SessionInfo(sid, r.get("body"), held, c[0], c[1])
        return [out[k] for k in sorted(out)]

    # ---- rows ----------------------------------------------------------------------------------

    def _apply(
        self,
        dt: Snapshot,
        p: int,
        session_id: str,
        changes: pa.Table,
        new_row: pa.Table | None = None,
        *,
        anchor: int | None = None,
    ) -> None:
        """Commit changes to one session's rows (and its new row), rewriting only its files and keeping its rows together.

        A new session row (an accept's) is numbered from `anchor`, a message of the session the same
        commit rewrites (so two receivers making the row both remove that message's file and
        conflict), without the partition's sequence fence: accepts of different sessions of one
        partition then never conflict, as two appends would. A session without messages (no
        anchor) has its row appended under the fence, so two accepts making it conflict too.
        """
        numbered = None
        if new_row is not None and anchor is not None:
            numbered = new_row.set_column(
                new_row.schema.get_field_index("sequence_number"), "sequence_number", pa.array([anchor | ROW_BIT], pa.int64())
            )
            new_row = None
        self.table.apply(dt, p, changes, new_row, group_by=GROUP_COLUMN, where=self._files_of(session_id), numbered_rows=numbered)

    def _read(
        self, dt: Snapshot, p: int, session_id: str, files: Sequence[FileInfo] | None = None
    ) -> tuple[pa.Table | None, pa.Table]:
        """The session's row (or None) and its live message rows in sequence order, from one read of its files.

        `files`: only these of the session's files (default: all of them), as `_head` and `settle` narrow the read.
        """
        sub = self.entity.subscription
        if files is None:
            files = self._session_files(dt, p, session_id)
        if not files:
            return None, empty_rows()
        t = pa.concat_tables([self.table.data.read(f.path, ROW_COLUMNS) for f in files])
        subs = t.column("subscription")
        in_sub = pc.is_null(subs) if sub is None else pc.fill_null(pc.equal(subs, sub), False)
        mine = pc.and_(pc.fill_null(pc.equal(t.column("session_id"), session_id), False), in_sub)
        # Positions found and ordered on the narrow columns, then at most one copy of the rows (bodies included):
        # none when every row is a live message in order, as on a session's first accept.
        at = pc.indices_nonzero(pc.and_(mine, pc.not_equal(t.column("state"), STATE_COMPLETED)))
        seqs = t.column("sequence_number").take(at)
        ordered = len(at) < 2 or pc.all(pc.less(seqs.slice(0, len(at) - 1), seqs.slice(1))).as_py()
        if not ordered:
            at = at.take(pc.sort_indices(seqs))
        kinds = t.column("kind").take(at)
        messages = at.filter(pc.equal(kinds, KIND_MESSAGE))
        whole = ordered and len(messages) == t.num_rows  # every row, in order: `messages` is 0..n-1
        rows = t if whole else t.combine_chunks().take(messages)  # one contiguous take: a chunked one costs per chunk
        found = at.filter(pc.equal(kinds, KIND_SESSION))
        row = t.slice(found[0].as_py(), 1) if len(found) else None
        return row, rows

    def _session_files(self, dt: Snapshot, p: int, session_id: str) -> builtins.list[FileInfo]:
        """The files that may hold the session's row or messages, by lowest sequence number (as the table lists them)."""
        holds = self._files_of(session_id)
        return [f for f in self.table.files(dt, p) if holds(f)]

    def _files_with(self, dt: Snapshot, lock: SessionLock, seqs: Sequence[int]) -> builtins.list[FileInfo]:
        """The session's files that hold its row or may hold one of these messages (by sequence range): what a settle reads."""
        wanted = sorted(seqs)
        sub = self.entity.subscription

        def holds(f: FileInfo) -> bool:
            i = bisect.bisect_left(wanted, f.min_seq)
            return i < len(wanted) and wanted[i] <= f.max_seq

        files = self._session_files(dt, lock.partition, lock.session_id)
        return [f for f in files if f.may_hold(KIND_SESSION, None, sub, lock.session_id) or holds(f)]

    def _head(self, dt: Snapshot, p: int, session_id: str, now: datetime, max_count: int) -> tuple[pa.Table | None, pa.Table]:
        """The session's row and its next messages a receive may take (`through_deliverable`), reading as few files as it can.

        Files are read in sequence order (the session row's always), doubling their number until the
        head holds `max_count` messages that come before any file left unread: a receive from a deep
        session costs what it takes, not the session's backlog. A head of expired messages may hold
        fewer deliverable ones; the receive then delivers fewer (its commit dead-letters the rest).
        """
        files = self._session_files(dt, p, session_id)
        sub = self.entity.subscription
        row_files = [f for f in files if f.may_hold(KIND_SESSION, None, sub, session_id)]
        message_files = [f for f in files if f not in row_files]
        k = 1
        while True:
            chosen = sorted(row_files + message_files[:k], key=lambda f: f.min_seq)
            row, rows = self._read(dt, p, session_id, chosen)
            head = lifecycle.through_deliverable(_next_messages(rows, now), now, self.entity.policy, max_count)
            rest = message_files[k:]
            if not rest:
                return row, head
            last = head.column("sequence_number")[-1].as_py() if head.num_rows else None
            if head.num_rows >= max_count and last is not None and last < rest[0].min_seq:
                return row, head
            k *= 2

    def _files_of(self, session_id: str) -> Callable[[FileInfo], bool]:
        """Test of the files that may hold a row (message or session row) of the session, by their statistics."""
        sub = self.entity.subscription
        return lambda f: f.may_hold(KIND_MESSAGE, None, sub, session_id) or f.may_hold(KIND_SESSION, None, sub, session_id)

    def _row(self, dt: Snapshot, p: int, session_id: str) -> pa.Table | None:
        """The session's row (state columns and body), or None before its first accept."""
        rows = self.table.scan(
            dt,
            p,
            ["lock_token", "locked_until_utc", *MUTABLE_COLUMNS, "body"],
            subscription=self.entity.subscription,
            kind=KIND_SESSION,
            session_id=session_id,
        )
        return rows.slice(0, 1) if rows.num_rows else None

    def _hold(self, dt: Snapshot, lock: SessionLock, now: datetime) -> pa.Table:
        """The session row, provided `lock` still holds it.

        SessionLockLostError when the lock expired, was released, or another receiver holds the session.
        """
        return self._check(self._row(dt, lock.partition, lock.session_id), lock, now)

    def _check(self, row: pa.Table | None, lock: SessionLock, now: datetime, *, releasing: bool = False) -> pa.Table:
        """`row` (the session's row as read, or None) provided `lock` still holds it: see `_hold`.

        A released lock (`Sessions.release`) holds nothing any more, except for the release itself (`releasing`).
        """
        if lock.released and not releasing:
            raise SessionLockLostError(f"the lock on session {lock.session_id!r} was released; accept the session again")
        if row is None:
            raise SessionLockLostError(f"session {lock.session_id!r} no longer exists")
        until = row.column("locked_until_utc")[0].as_py()
        if row.column("lock_token")[0].as_py() != lock.token or until is None or until <= now:
            raise SessionLockLostError(
                f"the lock on session {lock.session_id!r} expired or was taken by another receiver; accept the session again"
            )
        return row

    @staticmethod
    def _touch(row: pa.Table, op: str = OP_SET, *, body: bytes | None = None, until: datetime | None = None) -> pa.Table:
        """The change rewriting the held session's row with `op` (new body, new lock expiry).

        Every operation under the lock carries it: a takeover committed meanwhile rewrote the row
        too, so the operation's commit conflicts and then finds the lock lost (docs/storage.md).
        """
        values: dict[str, object] = {} if until is None else {"locked_until_utc": until}
        if op == OP_SET_BODY:
            values["body"] = pa.array([body], pa.binary())
        return lifecycle.changes(row, op, **values)

    def _locked_messages(self, dt: Snapshot, lock: SessionLock) -> pa.Table:
        """The session's message rows delivered under its current lock (main sub-queue rows with a lock token)."""
        rows = self.table.scan(dt, lock.partition, ROW_COLUMNS, subscription=self.entity.subscription, session_id=lock.session_id)
        return rows.filter(_held(rows))

    def _new_row(self, session_id: str, p: int, now: datetime, token: str, until: datetime) -> pa.Table:
        """A first session row, locked by its creator."""
        values = {
            PARTITION_COLUMN: p,
            "sequence_number": 0,
            "available_at_utc": None,
            "sub_queue": SUB_QUEUE_MAIN,
            "subscription": self.entity.subscription,
            "state": STATE_ACTIVE,
            "kind": KIND_SESSION,
            "enqueued_time_utc": now,
            "locked_until_utc": until,
            "lock_token": token,
            "delivery_count": 0,
            "message_id": f"$session/{session_id}",
            "session_id": session_id,
            "partition_key": session_id,
            "size_in_bytes": 0,
            "transfer_hop_count": 0,
        }
        return pa.Table.from_pylist([values], schema=ENTITY_SCHEMA)


def _picked(rows: pa.Table, some: pa.Table) -> pa.Array:
    """Which of `rows` are among `some` (by sequence number)."""
    return member_of(rows.column("sequence_number"), some.column("sequence_number"))


def _first_seq(changes: pa.Table) -> int | None:
    """The lowest sequence number among change rows of messages (never a session row's), or None without any."""
    seqs = changes.column("sequence_number")
    low = pc.min(seqs.filter(pc.equal(pc.bit_wise_and(seqs, ROW_BIT), 0))).as_py() if changes.num_rows else None
    return int(low) if low is not None else None


def _next_messages(rows: pa.Table, now: datetime, limit: int | None = None) -> pa.Table:
    """The session's next messages a receive may take (at most `limit`), in sequence order.

    Messages already delivered under the session lock (lock token set) are skipped: the holder
    may take later ones before settling them. An abandoned message has no lock token again, so
    as the earliest undelivered message it comes back before any later one.
    """
    visible = pc.and_(
        pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)),
        pc.and_(
            pc.and_(pc.equal(rows.column("state"), STATE_ACTIVE), pc.is_null(rows.column("lock_token"))),
            pc.fill_null(pc.less_equal(rows.column("available_at_utc"), pa.scalar(now, TIMESTAMP)), False),
        ),
    )
    return keep_rows(rows, visible).slice(0, limit)  # slice(0, None): all; no copy when every row is one


def _held(rows: pa.Table) -> pa.Array:
    """Which rows the session lock covers: locked rows of the main sub-queue.

    A session's dead letters are received without the session, under locks of their own (and
    dead-letter forwarding claims them the same way): no session operation touches those locks.
    """
    main = pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)
    return pc.and_(pc.is_valid(rows.column("lock_token")), main)


def _cleared(rows: pa.Table, now: datetime) -> pa.Table:
    """Rows with the message locks of an earlier session holder removed: active ones are available again now."""
    locked = _held(rows)
    if not pc.any(locked).as_py():
        return rows
    active = pc.equal(rows.column("state"), STATE_ACTIVE)
    again = pc.if_else(active, pa.scalar(now, TIMESTAMP), pa.scalar(None, TIMESTAMP))
    avail = pc.if_else(locked, again, rows.column("available_at_utc"))
    out = {
        "lock_token": pc.if_else(locked, pa.scalar(None, pa.string()), rows.column("lock_token")),
        "locked_until_utc": pc.if_else(locked, pa.scalar(None, TIMESTAMP), rows.column("locked_until_utc")),
        "available_at_utc": avail,
    }
    return with_columns(rows, **out)


def _session_until(rows: pa.Table, until: datetime) -> pa.Table:
    """Delivered rows whose lock expiry is the session's (session messages carry no lock of their own)."""
    if rows.num_rows == 0 or "locked_until_utc" not in rows.column_names:
        return rows
    locked = pc.is_valid(rows.column("lock_token"))
    return with_columns(rows, locked_until_utc=pc.if_else(locked, pa.scalar(until, TIMESTAMP), pa.scalar(None, TIMESTAMP)))


def _session_until_changes(changes: pa.Table, until: datetime) -> pa.Table:
    """Change rows in which every lock set follows the session lock's expiry (and active rows stay hidden until then)."""
    if changes.num_rows == 0:
        return changes
    locked = pc.is_valid(changes.column("lock_token"))
    active = pc.fill_null(pc.equal(changes.column("state"), STATE_ACTIVE), False)
    at = pa.scalar(until, TIMESTAMP)
    return with_columns(
        changes,
        locked_until_utc=pc.if_else(locked, at, changes.column("locked_until_utc")),
        available_at_utc=pc.if_else(pc.and_(locked, active), at, changes.column("available_at_utc")),
    )
