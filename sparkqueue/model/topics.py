"""Topic fan-out (SPEC §8): which subscriptions get a copy of each message, and what the copies look like.

A subscription's copies live in its topic's Delta table, tagged with the subscription's key, so
a send to a topic is one append: every matching subscription gets its copy atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.storage.schema import STATE_COMPLETED, TIMESTAMP

# Subscription key of the rows that only record an accepted message id, so a duplicate-detecting
# topic detects repeats even of messages no subscription took. Subscription names cannot start with '$'.
ACCEPTED_MARKER = "$accepted"


@dataclass(frozen=True)
class Rule:
    """A named filter with an optional action."""

    name: str
    filter: Any
    action: Any = None


@dataclass(frozen=True)
class Subscriber:
    """A subscription as fan-out sees it: the key its rows carry, and its rules."""

    key: str
    rules: tuple[Rule, ...]
    default_message_time_to_live: timedelta | None = None  # caps the TTL of the subscription's copies


def fan_out(rows: pa.Table, subscribers: list[Subscriber], record_ids: bool) -> pa.Table:
    """Copies of `rows` for every subscription whose rules match, plus id markers when `record_ids`.

    Rules without an action that match give one copy between them; each matching rule with an
    action gives a copy of its own, modified by the action. Filters are evaluated per batch.
    """
    parts: list[pa.Table] = []
    for sub in subscribers:
        plain: pa.Array | None = None
        for rule in sub.rules:
            hit = pc.fill_null(rule.filter.evaluate(rows), False)
            if rule.action is None:
                plain = hit if plain is None else pc.or_(plain, hit)
                continue
            matched = rows.filter(hit)
            if matched.num_rows:
                parts.append(_cap_ttl(_tag(rule.action.apply(matched).select(rows.schema.names), sub.key), sub))
        if plain is not None:
            matched = rows.filter(plain)
            if matched.num_rows:
                parts.append(_cap_ttl(_tag(matched, sub.key), sub))
    if record_ids:
        parts.append(_markers(rows))
    return pa.concat_tables([p.cast(rows.schema) for p in parts]) if parts else rows.schema.empty_table()


def _tag(rows: pa.Table, key: str) -> pa.Table:
    """Rows assigned to one subscription."""
    i = rows.schema.get_field_index("subscription")
    return rows.set_column(i, rows.schema.field(i), pa.array([key] * rows.num_rows, pa.string()))


def _cap_ttl(rows: pa.Table, sub: Subscriber) -> pa.Table:
    """Apply the subscription's default_message_time_to_live: a copy lives for the smaller of it and its own TTL."""
    ttl = sub.default_message_time_to_live
    if ttl is None:
        return rows
    cap_ms = int(ttl.total_seconds() * 1000)
    current = rows.column("time_to_live_ms")
    shorter = pc.fill_null(pc.less(pa.scalar(cap_ms, pa.int64()), current.cast(pa.int64())), True)
    ttl_i = rows.schema.get_field_index("time_to_live_ms")
    exp_i = rows.schema.get_field_index("expires_at_utc")
    capped_expiry = pc.add(rows.column("available_at_utc"), pa.scalar(ttl, pa.duration("us")))
    capped_ttl = pc.if_else(shorter, pa.scalar(cap_ms, pa.int64()), current.cast(pa.int64())).cast(current.type)
    rows = rows.set_column(ttl_i, rows.schema.field(ttl_i), capped_ttl)
    return rows.set_column(
        exp_i, rows.schema.field(exp_i), pc.if_else(shorter, capped_expiry.cast(TIMESTAMP), rows.column("expires_at_utc"))
    )


def _markers(rows: pa.Table) -> pa.Table:
    """Completed, body-less rows that keep each accepted message id for duplicate detection."""
    out = _tag(rows, ACCEPTED_MARKER)
    n = out.num_rows
    for name, value in (
        ("state", pa.array([STATE_COMPLETED] * n)),
        ("available_at_utc", pa.nulls(n, TIMESTAMP)),
        ("body", pa.nulls(n, pa.binary())),
        ("application_properties", pa.nulls(n, pa.string())),
    ):
        i = out.schema.get_field_index(name)
        out = out.set_column(i, out.schema.field(i), value)
    return out
