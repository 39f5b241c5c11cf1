"""Message lock states and their transitions, as change rows for the storage MERGE (docs/semantics.md §5).

Every function here is pure: it takes the current rows of a snapshot and returns the rows'
new mutable values. Storage applies them in one MERGE against that same snapshot, so a
concurrent change to any of the rows makes the commit fail rather than be overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.model.ids import lock_tokens
from sparkqueue.storage.schema import (
    STATE_ACTIVE,
    STATE_DEFERRED,
    SUB_QUEUE_DEAD_LETTER,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    conform,
    constant,
    keep_rows,
    with_columns,
)
from sparkqueue.storage.table import CHANGE_SCHEMA, OP_DELETE, OP_SET, OP_TOMBSTONE

MAX_DELIVERY_REASON = "MaxDeliveryCountExceeded"
TTL_EXPIRED_REASON = "TTLExpiredException"

COMPLETE = "complete"
ABANDON = "abandon"
DEFER = "defer"
DEAD_LETTER = "dead_letter"
RENEW = "renew"
SETTLE_OPS = (COMPLETE, ABANDON, DEFER, DEAD_LETTER, RENEW)
# Not a settlement: a receiver gives back messages locked for it but never handed to the application (prefetched).
RELEASE = "release"

# A dead-letter reason or description: one text for every settled item, or one per item (Spark's per-row columns).
Texts = str | None | Sequence[str | None]


@dataclass(frozen=True)
class Policy:
    """The entity settings that decide transitions."""

    lock_duration: timedelta
    max_delivery_count: int
    dead_lettering_on_message_expiration: bool
    keep_tombstones: bool  # duplicate-detecting entities keep completed ids until their window passes
    source: str  # entity name, recorded as dead_letter_source


# The change table's columns after sequence_number and op, with their types (CHANGE_SCHEMA's order).
_CHANGED_COLUMNS = [(f.name, f.type) for f in CHANGE_SCHEMA][2:]


def changes(rows: pa.Table, op: str, **values: Any) -> pa.Table:
    """Change rows for `rows`: their current mutable values, with `values` (scalars or arrays) replacing some."""
    n = rows.num_rows
    present = set(rows.column_names)  # a property that builds a new list at every call
    cols: list[pa.Array | pa.ChunkedArray] = [rows.column("sequence_number").combine_chunks(), constant(op, pa.string(), n)]
    for c, type_ in _CHANGED_COLUMNS:
        if c in values:
            v = values[c]
            cols.append(v if isinstance(v, (pa.Array, pa.ChunkedArray)) else constant(v, type_, n))
        elif c in present:
            cols.append(rows.column(c))
        else:
            cols.append(pa.nulls(n, type_))
    return conform(pa.table(cols, names=CHANGE_SCHEMA.names), CHANGE_SCHEMA)


def removal(policy: Policy) -> str:
    """How a settled message leaves: a tombstone where duplicate detection needs its id, else a delete."""
    return OP_TOMBSTONE if policy.keep_tombstones else OP_DELETE


def texts_of(value: Texts, positions: Sequence[int]) -> str | pa.Array | None:
    """The texts of the items at `positions` (the rows being settled, in order): the one text, or theirs."""
    if value is None or isinstance(value, str):
        return value
    return pa.array([value[i] for i in positions], pa.string())


def _dead_letter_values(
    reason: str | pa.Array | None, description: str | pa.Array | None, now: datetime, source: str
) -> dict[str, Any]:
    """A dead letter is active in its sub-queue, whatever it was (a deferred message dead-lettered by its delivery count too)."""
    return {
        "sub_queue": SUB_QUEUE_DEAD_LETTER,
        "state": STATE_ACTIVE,
        "available_at_utc": now,
        "locked_until_utc": None,
        "lock_token": None,
        "dead_letter_reason": reason,
        "dead_letter_error_description": description,
        "dead_letter_source": source,
    }


@dataclass
class Delivery:
    """Outcome of a receive on one partition: the change rows, and the delivered messages as rows."""

    changes: pa.Table
    delivered: pa.Table
    dead_lettered: int = 0
    expired: int = 0


def expired_rows(rows: pa.Table, now: datetime) -> pa.Array:
    """Per row: an active message of the main sub-queue past its expiry (deferred messages and dead letters never expire)."""
    in_main = pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)
    active = pc.and_(in_main, pc.equal(rows.column("state"), STATE_ACTIVE))
    return pc.and_(active, pc.fill_null(pc.less_equal(rows.column("expires_at_utc"), pa.scalar(now, TIMESTAMP)), False))


def scheduled_rows(rows: pa.Table, now: datetime) -> pa.Array:
    """Per row: a scheduled message not yet visible (active, main sub-queue, its time ahead); a dead letter is none."""
    in_main = pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)
    active = pc.and_(in_main, pc.equal(rows.column("state"), STATE_ACTIVE))
    ahead = pc.greater(rows.column("scheduled_enqueue_time_utc"), pa.scalar(now, TIMESTAMP))
    return pc.and_(active, pc.fill_null(ahead, False))


def expire(rows: pa.Table, now: datetime, policy: Policy) -> pa.Table:
    """Change rows for expired messages: dead-lettered (TTLExpiredException) or removed, as the entity's setting says."""
    if policy.dead_lettering_on_message_expiration:
        desc = "The message expired before it could be delivered."
        return changes(rows, OP_SET, **_dead_letter_values(TTL_EXPIRED_REASON, desc, now, policy.source))
    return changes(rows, removal(policy))


def _undeliverable(rows: pa.Table, now: datetime, policy: Policy) -> tuple[pa.Array, pa.Array]:
    """Per row: (expired, over its max delivery count): what a receive dead-letters or drops instead of delivering."""
    in_main = pc.equal(rows.column("sub_queue"), SUB_QUEUE_MAIN)
    expired = expired_rows(rows, now)
    next_count = pc.add(rows.column("delivery_count"), 1)
    over = pc.and_(pc.and_(in_main, pc.invert(expired)), pc.greater(next_count, policy.max_delivery_count))
    return expired, over


def through_deliverable(rows: pa.Table, now: datetime, policy: Policy, limit: int) -> pa.Table:
    """The leading candidate rows that hold at most `limit` deliverable ones, with the undeliverable ones among them.

    A receive takes those along (its commit dead-letters or drops them), so expired or over-delivered
    messages never make a receive come back empty while a live message waits behind them.
    """
    if rows.num_rows <= limit:  # the usual case: no more rows than asked for, nothing to count
        return rows
    expired, over = _undeliverable(rows, now, policy)
    counts = pc.cumulative_sum(pc.invert(pc.or_(expired, over)).cast(pa.int64()))
    if counts[-1].as_py() <= limit:
        return rows
    return rows.slice(0, pc.index(counts, limit + 1).as_py())  # up to the row that would be one too many


def deliver(rows: pa.Table, now: datetime, policy: Policy, *, delete: bool) -> Delivery:
    """Lock (or, with delete=True, remove) candidate rows; expire and dead-letter those that must not be delivered."""
    expired, over = _undeliverable(rows, now, policy)
    ok = pc.invert(pc.or_(expired, over))
    parts: list[pa.Table] = []
    exp_rows = rows.filter(expired)
    if exp_rows.num_rows:
        parts.append(expire(exp_rows, now, policy))
    over_rows = rows.filter(over)
    if over_rows.num_rows:
        desc = f"Message could not be consumed after {policy.max_delivery_count} delivery attempts."
        parts.append(changes(over_rows, OP_SET, **_dead_letter_values(MAX_DELIVERY_REASON, desc, now, policy.source)))
    # The stored count includes the delivery in progress; a message reports only the deliveries that
    # ended (0 on the first delivery, as the Python SDK): see message.reported_delivery_count. Rows
    # removed on receipt hold no lock, so they are returned with the earlier count.
    got = keep_rows(rows, ok)
    counted = with_columns(got, delivery_count=pc.add(got.column("delivery_count"), 1).cast(pa.int32()))
    if got.num_rows:
        if delete:
            parts.append(changes(counted, removal(policy)))
            got = with_columns(
                got, lock_token=pa.nulls(got.num_rows, pa.string()), locked_until_utc=pa.nulls(got.num_rows, TIMESTAMP)
            )
        else:
            until = now + policy.lock_duration
            tokens = lock_tokens(got.column("sequence_number"))
            avail = pc.if_else(
                pc.equal(got.column("state"), STATE_ACTIVE), pa.scalar(until, TIMESTAMP), got.column("available_at_utc")
            )
            lock = {
                "lock_token": tokens,
                "locked_until_utc": constant(until, TIMESTAMP, got.num_rows),
                "available_at_utc": avail,
            }
            got = with_columns(counted, **lock)
            parts.append(changes(got, OP_SET))
    change_table = pa.concat_tables(parts) if parts else CHANGE_SCHEMA.empty_table()
    return Delivery(
        change_table,
        got,
        dead_lettered=over_rows.num_rows + (exp_rows.num_rows if policy.dead_lettering_on_message_expiration else 0),
        expired=exp_rows.num_rows,
    )


def lock_valid(rows: pa.Table, tokens: Sequence[str] | pa.Array, now: datetime) -> list[bool]:
    """Per row: does `tokens[i]` hold the current, unexpired lock of `rows[i]`?"""
    same = pc.equal(rows.column("lock_token"), tokens if isinstance(tokens, pa.Array) else pa.array(tokens, pa.string()))
    live = pc.greater(rows.column("locked_until_utc"), pa.scalar(now, TIMESTAMP))
    valid: list[bool] = pc.fill_null(pc.and_(same, live), False).to_pylist()
    return valid


def settle(
    rows: pa.Table,
    op: str,
    now: datetime,
    policy: Policy,
    reason: str | pa.Array | None = None,
    description: str | pa.Array | None = None,
) -> pa.Table:
    """Change rows for settling locked rows with `op` (complete, abandon, defer, dead_letter, renew, release).

    A dead letter's reason and description are one text for all rows, or an array with one per row.
    """
    released = {"lock_token": None, "locked_until_utc": None}
    deferred = pc.equal(rows.column("state"), STATE_DEFERRED)
    if op == COMPLETE:
        return changes(rows, removal(policy))
    if op in (ABANDON, RELEASE):
        # An abandoned deferred message stays deferred: only receive_deferred_messages reaches it.
        avail = pc.if_else(deferred, pa.scalar(None, TIMESTAMP), pa.scalar(now, TIMESTAMP))
        if op == RELEASE:  # an abandon that also undoes the delivery the application never saw
            count = pc.subtract(rows.column("delivery_count"), 1).cast(pa.int32())
            return changes(rows, OP_SET, available_at_utc=avail, delivery_count=count, **released)
        return changes(rows, OP_SET, available_at_utc=avail, **released)
    if op == DEFER:
        return changes(rows, OP_SET, state=STATE_DEFERRED, available_at_utc=None, **released)
    if op == DEAD_LETTER:
        return changes(rows, OP_SET, **_dead_letter_values(reason, description, now, policy.source))
    if op == RENEW:
        until = now + policy.lock_duration
        avail = pc.if_else(deferred, pa.scalar(None, TIMESTAMP), pa.scalar(until, TIMESTAMP))
        return changes(rows, OP_SET, locked_until_utc=until, available_at_utc=avail)
    raise ValueError(f"unknown settle op {op!r}")
