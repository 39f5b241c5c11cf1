"""Sessions (SPEC §6): an exclusive, expiring lock per session id, FIFO delivery within it, and session state.

Each session has one row (kind "session") in its partition holding the session lock and the
state (in `body`). Every session operation rewrites that row in the same commit as its own
changes ("touch"), so an operation racing a receiver that took the session over always fails
its commit and then sees the lost lock, never acting on a session it no longer holds.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import SessionCannotBeLockedError, SessionLockLostError
from sparkqueue.model import lifecycle
from sparkqueue.model.entity import POLL_MAX_S, POLL_MIN_S, ROW_COLUMNS, Entity, Guard, empty_rows, utcnow
from sparkqueue.model.ids import new_ids
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.storage.log import CommitConflict, Snapshot
from sparkqueue.storage.retry import retry_commit
from sparkqueue.storage.schema import (
    ENTITY_SCHEMA,
    KIND_MESSAGE,
    KIND_SESSION,
    PARTITION_COLUMN,
    STATE_ACTIVE,
    STATE_DEFERRED,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
)
from sparkqueue.storage.table import MUTABLE_COLUMNS, OP_DELETE, OP_SET, OP_SET_BODY, empty_changes

log = logging.getLogger(__name__)


@dataclass
class SessionLock:
    """A receiver's hold on one session."""

    session_id: str
    partition: int
    token: str
    locked_until: datetime


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

    def accept(self, session_id: str | None, wait_s: float) -> SessionLock:
        """Lock a named session, or (session_id None) the next session with available messages."""
        if session_id is not None:
            return retry_commit(lambda: self._accept_named(session_id), self.entity.deadline(), f"accept session {session_id!r}")
        give_up = time.monotonic() + wait_s
        poll = POLL_MIN_S
        while True:
            lock = self._accept_next()
            if lock is not None:
                return lock
            if time.monotonic() >= give_up:
                raise SessionCannotBeLockedError(
                    f"no session of {self.entity.name!r} with available messages could be locked within {wait_s:g}s"
                )
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)

    def _accept_named(self, session_id: str) -> SessionLock:
        """One attempt to lock a session; raises SessionCannotBeLockedError when another receiver holds it."""
        p = partition_for_key(session_id, self.entity.partition_count)
        dt = self.table.snapshot()
        now = utcnow()
        row = self._row(dt, p, session_id)
        token = new_ids(1)[0]
        until = now + self.entity.policy.lock_duration
        if row is None:
            self.table.apply(dt, p, empty_changes(), new_rows=self._new_row(session_id, p, now, token, until))
            return SessionLock(session_id, p, token, until)
        held = row.column("locked_until_utc")[0].as_py()
        if row.column("lock_token")[0].as_py() is not None and held is not None and held > now:
            raise SessionCannotBeLockedError(f"session {session_id!r} is locked by another receiver until {held.isoformat()}")
        changes = [
            lifecycle.changes(row, OP_SET, lock_token=token, locked_until_utc=until),
            self._release_messages(dt, p, session_id, now),
        ]
        self.table.apply(dt, p, pa.concat_tables(changes))
        return SessionLock(session_id, p, token, until)

    def _accept_next(self) -> SessionLock | None:
        """Lock the first free session that has an available message, trying partitions from a rotating start."""
        start = next(self._start)
        for i in range(self.entity.partition_count):
            p = (start + i) % self.entity.partition_count
            if not self.entity.available(p):
                continue
            dt = self.table.snapshot()
            seen: set[str] = set()
            window = 1000
            while True:
                now = utcnow()
                cands = self.table.candidates(dt, p, SUB_QUEUE_MAIN, now, window, subscription=self.entity.subscription)
                for sid in cands.column("session_id").to_pylist():
                    if sid is None or sid in seen:
                        continue
                    seen.add(sid)
                    try:
                        return self._accept_named(sid)
                    except (SessionCannotBeLockedError, CommitConflict):
                        continue
                if cands.num_rows < window:
                    break
                window *= 4  # every session in the window is held: a free one may wait further back
        return None

    # ---- receive and settle --------------------------------------------------------------------

    def receive(self, lock: SessionLock, max_count: int, *, delete: bool, wait_s: float) -> pa.Table:
        """The session's next messages in sequence order; none while an earlier one is still locked."""
        give_up = time.monotonic() + wait_s
        poll = POLL_MIN_S
        while True:
            got = retry_commit(lambda: self._receive_once(lock, max_count, delete), self.entity.deadline(), "session receive")
            if got.num_rows or time.monotonic() >= give_up:
                return got
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)

    def _receive_once(self, lock: SessionLock, max_count: int, delete: bool) -> pa.Table:
        dt = self.table.snapshot()
        now = utcnow()
        touch = self.guard(lock)(dt, lock.partition, now)
        rows = self.table.scan(dt, lock.partition, ROW_COLUMNS, subscription=self.entity.subscription, session_id=lock.session_id)
        head = _deliverable_head(rows, now, max_count)
        if head.num_rows == 0:
            return empty_rows()
        d = lifecycle.deliver(head, now, self.entity.policy, delete=delete)
        self.table.apply(dt, lock.partition, pa.concat_tables([d.changes, touch]))
        return d.delivered

    def guard(self, lock: SessionLock) -> Guard:
        """A check run inside each commit: the session lock must still be ours; returns the row's touch."""

        def check(dt: Snapshot, partition: int, now: datetime) -> pa.Table:
            row = self._held_row(dt, lock, now)
            return lifecycle.changes(row, OP_SET)

        return check

    def receive_deferred(self, lock: SessionLock, seqs: list[int], *, delete: bool) -> pa.Table:
        """The held session's deferred messages with these sequence numbers; other sessions' are never returned."""
        mine = [s for s in seqs if s >> 48 == lock.partition]

        def attempt() -> pa.Table:
            dt = self.table.snapshot()
            now = utcnow()
            touch = self.guard(lock)(dt, lock.partition, now)  # raises SessionLockLostError when the lock is gone
            if not mine:
                return empty_rows()
            rows = self.table.rows_by_sequence(dt, lock.partition, mine, ROW_COLUMNS)
            until = rows.column("locked_until_utc")
            lock_free = pc.or_kleene(pc.is_null(until), pc.less_equal(until, pa.scalar(now, TIMESTAMP)))
            in_session = pc.fill_null(pc.equal(rows.column("session_id"), lock.session_id), False)
            ours = pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), in_session)
            deferred = pc.and_(pc.equal(rows.column("state"), STATE_DEFERRED), pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN))
            rows = rows.filter(pc.and_(pc.and_(deferred, lock_free), pc.and_(ours, self.entity._mine(rows))))
            if rows.num_rows == 0:
                return empty_rows()
            d = lifecycle.deliver(rows, now, self.entity.policy, delete=delete)
            self.table.apply(dt, lock.partition, pa.concat_tables([d.changes, touch]))
            return d.delivered

        return retry_commit(attempt, self.entity.deadline(), "receive deferred session messages")

    # ---- lock and state ------------------------------------------------------------------------

    def renew(self, lock: SessionLock) -> datetime:
        """Extend the session lock by lock_duration; returns the new expiry."""

        def attempt() -> datetime:
            dt = self.table.snapshot()
            now = utcnow()
            row = self._held_row(dt, lock, now)
            until = now + self.entity.policy.lock_duration
            self.table.apply(dt, lock.partition, lifecycle.changes(row, OP_SET, locked_until_utc=until))
            return until

        lock.locked_until = retry_commit(attempt, self.entity.deadline(), "renew session lock")
        return lock.locked_until

    def get_state(self, lock: SessionLock) -> bytes | None:
        """The session state stored with the session."""
        row = self._held_row(self.table.snapshot(), lock, utcnow())
        return row.column("body")[0].as_py()

    def set_state(self, lock: SessionLock, state: bytes | None) -> None:
        """Replace (or clear, with None) the session state, in one commit with the session lock check."""

        def attempt() -> None:
            dt = self.table.snapshot()
            row = self._held_row(dt, lock, utcnow())
            self.table.apply(dt, lock.partition, lifecycle.changes(row, OP_SET_BODY, body=pa.array([state], pa.binary())))

        retry_commit(attempt, self.entity.deadline(), "set session state")

    def release(self, lock: SessionLock) -> None:
        """Give the session up at once, releasing its locked messages too; a lost lock is left alone.

        A session left with no state and no messages is forgotten (its row deleted), so finished
        sessions do not pile up as one small file each; accepting it again starts afresh.
        """

        def attempt() -> None:
            dt = self.table.snapshot()
            now = utcnow()
            try:
                row = self._held_row(dt, lock, now)
            except SessionLockLostError:
                return
            sub = self.entity.subscription
            if (
                row.column("body")[0].as_py() is None
                and not self.table.scan(
                    dt, lock.partition, ["sequence_number"], subscription=sub, session_id=lock.session_id
                ).num_rows
            ):
                self.table.apply(dt, lock.partition, lifecycle.changes(row, OP_DELETE))
                return
            release = lifecycle.changes(row, OP_SET, lock_token=None, locked_until_utc=None)
            self.table.apply(
                dt, lock.partition, pa.concat_tables([release, self._release_messages(dt, lock.partition, lock.session_id, now)])
            )

        retry_commit(attempt, self.entity.deadline(), "release session")

    def list(self) -> list[SessionInfo]:
        """Every session that has a session row or messages, with its state and counts."""
        out: dict[str, SessionInfo] = {}
        now = utcnow()
        dt = self.table.snapshot()
        for p in range(self.entity.partition_count):
            if not self.entity.available(p):
                continue
            sub = self.entity.subscription
            msgs = self.table.scan(dt, p, ["sub_queue", "session_id", "state"], subscription=sub)
            msgs = msgs.filter(pc.equal(msgs.column("sub_queue"), SUB_QUEUE_MAIN))
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
                out[sid] = SessionInfo(sid, r.get("body"), held, c[0], c[1])
        return [out[k] for k in sorted(out)]

    # ---- rows ----------------------------------------------------------------------------------

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

    def _held_row(self, dt: Snapshot, lock: SessionLock, now: datetime) -> pa.Table:
        """The session row, provided `lock` still holds it; otherwise SessionLockLostError."""
        row = self._row(dt, lock.partition, lock.session_id)
        if row is None:
            raise SessionLockLostError(f"session {lock.session_id!r} no longer exists")
        until = row.column("locked_until_utc")[0].as_py()
        if row.column("lock_token")[0].as_py() != lock.token or until is None or until <= now:
            raise SessionLockLostError(
                f"the lock on session {lock.session_id!r} expired or was taken by another receiver; accept the session again"
            )
        return row

    def _release_messages(self, dt: Snapshot, p: int, session_id: str, now: datetime) -> pa.Table:
        """Changes that clear the message locks of a session: its new holder starts from the earliest message."""
        rows = self.table.scan(dt, p, ROW_COLUMNS, subscription=self.entity.subscription, session_id=session_id)
        rows = rows.filter(pc.is_valid(rows.column("lock_token")))
        if rows.num_rows == 0:
            return empty_changes()
        avail = pc.if_else(pc.equal(rows.column("state"), STATE_ACTIVE), pa.scalar(now, TIMESTAMP), pa.scalar(None, TIMESTAMP))
        return lifecycle.changes(rows, OP_SET, lock_token=None, locked_until_utc=None, available_at_utc=avail)

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


def _deliverable_head(rows: pa.Table, now: datetime, limit: int) -> pa.Table:
    """The leading run of a session's visible active messages that are not locked, at most `limit`.

    Stops at the first locked message: a session's next message is never delivered while an
    earlier one is locked (strict FIFO across abandon and lock expiry).
    """
    visible = pc.and_(
        pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)),
        pc.and_(
            pc.equal(rows.column("state"), STATE_ACTIVE),
            pc.invert(pc.fill_null(pc.greater(rows.column("scheduled_enqueue_time_utc"), pa.scalar(now, TIMESTAMP)), False)),
        ),
    )
    rows = rows.filter(visible)
    until = rows.column("locked_until_utc").to_pylist()
    tokens = rows.column("lock_token").to_pylist()
    n = 0
    for tok, u in zip(tokens, until, strict=True):
        if n >= limit or (tok is not None and u is not None and u > now):
            break
        n += 1
    return rows.slice(0, n)
