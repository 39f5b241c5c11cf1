"""Topic fan-out (docs/semantics.md §8): which subscriptions get a copy of each message, and what the copies look like.

A subscription's copies live in its topic's Delta table, tagged with the subscription's key, so
a send to a topic is one append: every matching subscription gets its copy atomically.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import InvalidOperationError
from sparkqueue.model import limits
from sparkqueue.model.filters import ActionValueTooLargeError
from sparkqueue.storage.schema import (
    ID_RECORD,
    KIND_MESSAGE,
    STATE_ACTIVE,
    STATE_COMPLETED,
    STRING_PROPERTY_COLUMNS,
    SUB_QUEUE_DEAD_LETTER,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    constant,
    keep_rows,
    with_columns,
)
from sparkqueue.storage.table import partition_of

# Subscription key of the rows that only record an accepted message id, so a duplicate-detecting
# topic detects repeats even of messages no subscription took (and only of ids the topic accepted).
log = logging.getLogger(__name__)

ACCEPTED_MARKER = ID_RECORD
# A copy a rule action would leave invalid (too large, an id over 128 characters, a TTL that is not
# positive, a property JSON cannot hold) is dead-lettered in its subscription, unmodified, with this reason.
RULE_ACTION_REASON = "RuleActionViolation"
# A copy without a session id for a subscription that requires sessions could never be received
# there, so it is dead-lettered in that subscription at fan-out with this reason.
SESSION_REQUIRED_REASON = "SessionIdRequired"
# A message a subscription's rule failed on (its evaluation raised) is dead-lettered there with this reason
# when the subscription has dead_lettering_on_filter_evaluation_exceptions (docs/semantics.md §8).
FILTER_ERROR_REASON = "FilterEvaluationException"
# The application property naming the rule whose action made a copy (Service Bus topic filters).
RULE_NAME_PROPERTY = "RuleName"
_KEY_COLUMNS = ("message_id", "session_id", "partition_key")
_ORIGIN = "__origin"  # fan-out's working column: the index of the message a copy came from (never stored)
# What a message's copies share unless a rule action changed it: the run of them names the message (copy_run).
COPY_KEY = ("message_id", "enqueued_time_utc")


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
    requires_session: bool = False  # copies without a session id are dead-lettered (SESSION_REQUIRED_REASON)
    forwards: bool = False  # forward_to: its copies move on at once, so none of them names a message (by_message)
    dead_letter_on_filter_errors: bool = True  # dead_lettering_on_filter_evaluation_exceptions


def fan_out(rows: pa.Table, subscribers: list[Subscriber], record_ids: bool, max_message_bytes: int | None = None) -> pa.Table:
    """Copies of `rows` for every subscription whose rules match, plus id markers when `record_ids`.

    Rules without an action that match give one copy between them; each matching rule with an
    action gives a copy of its own, modified by the action and checked again against the message
    limits (`max_message_bytes`, default the standard tier's). Filters are evaluated per batch.
    Each message's copies come together, in message order (by_message), markers last.
    """
    cap = max_message_bytes if max_message_bytes is not None else limits.MAX_MESSAGE_BYTES[limits.STANDARD]
    indexed = rows.append_column(_ORIGIN, pa.array(range(rows.num_rows), pa.int64()))
    parts: list[tuple[pa.Table, bool]] = []  # (copies, whether they leave their subscription at once)
    for sub in subscribers:
        try:
            mine = _copies(indexed, sub, cap)
        except MemoryError:
            raise  # the process's trouble, not a message's: the send fails and stores nothing
        except Exception:  # a rule failed on some message of the batch: find which, one message at a time
            mine = _copies_one_by_one(indexed, sub, cap)
        if sub.requires_session:
            mine = [sessionless_dead_lettered(p, "subscription") for p in mine]
        parts.extend((p, sub.forwards) for p in mine)
    out = [by_message(parts, rows)] if parts else []
    if record_ids:
        out.append(_markers(rows))
    return pa.concat_tables([p.cast(rows.schema) for p in out]) if out else rows.schema.empty_table()


def _copies(indexed: pa.Table, sub: Subscriber, cap: int) -> list[pa.Table]:
    """One subscription's copies of the messages (with _ORIGIN): one per matching action rule, one for the plain rules."""
    out: list[pa.Table] = []
    plain: pa.Array | None = None
    for rule in sub.rules:
        hit = pc.fill_null(rule.filter.evaluate(indexed), False)
        if rule.action is None:
            plain = hit if plain is None else pc.or_(plain, hit)
            continue
        matched = indexed.filter(hit)
        if matched.num_rows:
            acted = with_rule_name(rule.action.apply(matched, cap).select(indexed.schema.names), rule.name)
            acted = checked_action_copies(matched, acted, cap, key_set=rule.action.sets("partition_key"))
            out.append(_cap_ttl(_tag(acted, sub.key), sub))
    if plain is not None:
        matched = indexed.filter(plain)
        if matched.num_rows:
            out.append(_cap_ttl(_tag(matched, sub.key), sub))
    return out


def with_rule_name(rows: pa.Table, name: str) -> pa.Table:
    """Copies made by a rule with an action carry the application property RuleName, the rule's name (docs/semantics.md §8).

    It replaces a RuleName the message or the action set, in any letter case (property names are case-insensitive).
    """
    texts = []
    for text in rows.column("application_properties").to_pylist():
        props = json.loads(text) if text else {}
        props = {key: value for key, value in props.items() if key.lower() != RULE_NAME_PROPERTY.lower()}
        props[RULE_NAME_PROPERTY] = name
        texts.append(json.dumps(props, ensure_ascii=False))  # as message.properties_json: sizes count UTF-8
    return _set(rows, application_properties=pa.array(texts, pa.string()))


def _copies_one_by_one(indexed: pa.Table, sub: Subscriber, cap: int) -> list[pa.Table]:
    """A subscription's copies when a rule raised: each message alone, and one whose rules raise is handled as Service Bus does.

    With `dead_lettering_on_filter_evaluation_exceptions` (the default) that message gets a copy in the
    subscription's dead-letter queue, its reason the error's name; without it, the subscription gets none.
    The other subscriptions, and this one's other messages, are not affected.
    """
    out: list[pa.Table] = []
    for i in range(indexed.num_rows):
        one = indexed.slice(i, 1)
        try:
            out.extend(_copies(one, sub, cap))
        except MemoryError:
            raise
        except ActionValueTooLargeError as exc:  # as checked_action_copies treats a copy grown too large
            out.append(_cap_ttl(_tag(_dead_lettered(one, RULE_ACTION_REASON, str(exc)), sub.key), sub))
        except Exception as exc:
            log.info("a rule of subscription %s failed on message %s: %r", sub.key, one.column("message_id")[0], exc)
            if sub.dead_letter_on_filter_errors:
                dead = _dead_lettered(one, FILTER_ERROR_REASON, f"{type(exc).__name__}: {exc}"[:1024])
                out.append(_cap_ttl(_tag(dead, sub.key), sub))
    return out


def _dead_lettered(rows: pa.Table, reason: str, description: str | pa.Array) -> pa.Table:
    """The rows as copies in the subscription's dead-letter queue, with a reason and description."""
    return _set(
        rows,
        sub_queue=SUB_QUEUE_DEAD_LETTER,
        state=STATE_ACTIVE,
        dead_letter_reason=reason,
        dead_letter_error_description=description,
    )


def by_message(parts: list[tuple[pa.Table, bool]], rows: pa.Table) -> pa.Table:
    """The copies (with _ORIGIN); with scheduled messages, in message order, each message's together, those staying first.

    One message's copies then take consecutive sequence numbers, and its first copy is one that
    keeps the message's id and enqueue time in its subscription's main queue (unless it has none):
    the number that names the message on a topic (first_copies, copy_run; docs/semantics.md §5).
    Copies a rule action renamed or rescheduled, dead-lettered at fan-out, or of forwarding
    subscriptions come after it.
    """
    schema = rows.schema.append(pa.field(_ORIGIN, pa.int64()))
    copies = pa.concat_tables([p.cast(schema) for p, _ in parts])
    # Only a scheduled message can be cancelled: other sends keep each subscription's copies together (no sort).
    if len(parts) > 1 and rows.column("scheduled_enqueue_time_utc").null_count < rows.num_rows:
        origin = copies.column(_ORIGIN)
        forwarded = pa.chunked_array([constant(f, pa.bool_(), p.num_rows) for p, f in parts], pa.bool_())
        same = pc.and_(_as_sent(copies, rows, origin), pc.equal(copies.column("sub_queue"), SUB_QUEUE_MAIN))
        moved = pc.or_(pc.invert(same), forwarded).cast(pa.int8())
        keys = pa.table({"origin": origin, "moved": moved})
        copies = copies.take(pc.sort_indices(keys, sort_keys=[("origin", "ascending"), ("moved", "ascending")]))
    return copies.drop_columns([_ORIGIN])


def _as_sent(copies: pa.Table, rows: pa.Table, origin: pa.ChunkedArray) -> pa.ChunkedArray:
    """Whether each copy keeps its message's id and enqueue time (no rule action renamed or rescheduled it)."""
    same = [pc.fill_null(pc.equal(copies.column(c), pc.take(rows.column(c), origin)), False) for c in COPY_KEY]
    return pc.and_(*same)


def first_copies(stored: pa.Table, sent: pa.Table) -> pa.Table:
    """Each message's first copy among the copies a topic send stored (sequence order per partition): its number names it.

    A first copy keeps the id and enqueue time of a message in `sent` (the rows before fan-out) and
    does not follow a copy with the same two (copy_run).
    """
    pairs = set(_copy_keys(sent))
    seqs = stored.column("sequence_number").to_pylist()
    keys = _copy_keys(stored)
    first = [
        keys[i] in pairs and (i == 0 or keys[i] != keys[i - 1] or partition_of(seqs[i]) != partition_of(seqs[i - 1]))
        for i in range(len(seqs))
    ]
    return stored.filter(pa.array(first, pa.bool_()))


def live_copies(rows: pa.Table) -> pa.Table:
    """The rows that are subscriptions' message copies (no session rows, id markers or tombstones)."""
    sub = rows.column("subscription")
    keep = pc.and_(
        pc.and_(pc.equal(rows.column("kind"), KIND_MESSAGE), pc.not_equal(rows.column("state"), STATE_COMPLETED)),
        pc.fill_null(pc.not_equal(sub, ACCEPTED_MARKER), False),
    )
    return rows.filter(keep)


def copy_run(copies: pa.Table, seq: int) -> tuple[int, int] | None:
    """Index range [i, j) in `copies` (live copies, in sequence order) of the copies of the message whose copy is `seq`.

    They are the run of consecutive copies sharing that copy's id and enqueue time (by_message).
    None when no live copy has that number.
    """
    seqs = copies.column("sequence_number").to_pylist()
    if seq not in seqs:
        return None
    keys = _copy_keys(copies)
    i = j = seqs.index(seq)
    while i > 0 and keys[i - 1] == keys[j]:
        i -= 1
    while j < len(keys) and keys[j] == keys[i]:
        j += 1
    return i, j


def _copy_keys(rows: pa.Table) -> list[tuple[Any, ...]]:
    """Each row's COPY_KEY values."""
    return list(zip(*(rows.column(c).to_pylist() for c in COPY_KEY), strict=True))


def check_session_action(action: Any, requires_session: bool, partition_count: int, subscription: str) -> None:
    """Refuse a rule action setting sys.SessionId on a session subscription of a partitioned topic (docs/semantics.md §8).

    The copy stays in its message's partition, while a session receiver looks for a session in the
    partition its id selects: nobody could ever receive it. With one partition both are the same.
    """
    if action is None or not requires_session or partition_count <= 1 or not action.sets("session_id"):
        return
    raise InvalidOperationError(
        f"subscription {subscription!r} requires sessions and its topic is partitioned: a rule action that sets "
        "sys.SessionId would leave the copy in its message's partition while receivers of its new session look in "
        "the partition that session id selects, so nobody could receive it. Set the session id when sending, or use "
        "a topic created with enable_partitioning=False; nothing was changed"
    )


def checked_action_copies(original: pa.Table, acted: pa.Table, max_bytes: int, *, key_set: bool = False) -> pa.Table:
    """Rule-action copies with enqueue time, size and expiry recomputed; a copy made invalid is dead-lettered unmodified.

    A message id the action left null reads as "" (the schema holds no null id), which _violations refuses.
    """
    acted = with_columns(acted, message_id=pc.fill_null(acted.column("message_id"), ""))
    if not key_set:  # an action that sets sys.PartitionKey itself keeps what it set (_violations checks it)
        acted = _key_follows_session(original, acted)
    acted = _recompute_size(_recompute_expiry(_recompute_schedule(original, acted.cast(original.schema))))
    problems = _violations(acted, max_bytes)
    if not any(problems):
        return acted
    bad = pa.array([p is not None for p in problems], pa.bool_())
    dead = _dead_lettered(original.filter(bad), RULE_ACTION_REASON, pa.array([p for p in problems if p is not None], pa.string()))
    return pa.concat_tables([acted.filter(pc.invert(bad)), dead.cast(original.schema)])


def sessionless_dead_lettered(copies: pa.Table, entity_kind: str) -> pa.Table:
    """Copies arriving in a session-requiring entity ("subscription", "queue"), those without a session id in its dead letters.

    A message no session receiver could ever take would otherwise sit there unreceivable.
    """
    # A copy dead-lettered already (a rule action left it invalid) keeps its reason: dead letters need no session.
    missing = pc.and_(pc.is_null(copies.column("session_id")), pc.not_equal(copies.column("sub_queue"), SUB_QUEUE_DEAD_LETTER))
    if not pc.any(missing).as_py():
        return copies
    why = f"the {entity_kind} requires sessions and the message has no session_id"
    dead = _dead_lettered(copies.filter(missing), SESSION_REQUIRED_REASON, why)
    return pa.concat_tables([copies.filter(pc.invert(missing)), dead.cast(copies.schema)])


def _set(rows: pa.Table, **values: Any) -> pa.Table:
    """Replace columns with a scalar for every row, or an array (cast to the column's type)."""
    arrays = {}
    for name, value in values.items():
        type_ = rows.schema.field(name).type
        arr = value if isinstance(value, (pa.Array, pa.ChunkedArray)) else constant(value, type_, rows.num_rows)
        arrays[name] = arr.cast(type_)
    return with_columns(rows, **arrays)


def _recompute_schedule(original: pa.Table, acted: pa.Table) -> pa.Table:
    """Copies whose action set, changed or removed sys.ScheduledEnqueueTimeUtc: enqueued and available when that
    time makes them visible, as a send with it would store them (message_rows; docs/semantics.md §8).

    An action can postpone a scheduled message's copy but not bring it forward: an earlier or no time keeps the message's.
    """
    before = original.column("scheduled_enqueue_time_utc")
    earlier = pc.fill_null(pc.less(acted.column("scheduled_enqueue_time_utc"), before), pc.is_valid(before))
    acted = _set(acted, scheduled_enqueue_time_utc=pc.if_else(earlier, before, acted.column("scheduled_enqueue_time_utc")))
    after = acted.column("scheduled_enqueue_time_utc")
    both_null = pc.and_(pc.is_null(before), pc.is_null(after))
    changed = pc.invert(pc.or_(both_null, pc.fill_null(pc.equal(before, after), False)))
    if not pc.any(changed).as_py():
        return acted
    # The send's time: the enqueue time of a message that was not scheduled ahead; else it is now (fan-out runs in the send).
    enqueued, clock = original.column("enqueued_time_utc"), pa.scalar(datetime.now(UTC), TIMESTAMP)
    now = pc.if_else(pc.less(enqueued, clock), enqueued, clock)
    visible = pc.if_else(pc.fill_null(pc.greater(after, now), False), after, now)
    return _set(
        acted,
        enqueued_time_utc=pc.if_else(changed, visible, acted.column("enqueued_time_utc")),
        available_at_utc=pc.if_else(changed, visible, acted.column("available_at_utc")),
    )


def _recompute_expiry(rows: pa.Table) -> pa.Table:
    """expires_at_utc = enqueued_time_utc + time_to_live after an action changed sys.TimeToLive (never past year 9999)."""
    ttl = rows.column("time_to_live_ms").cast(pa.int64())
    never = pc.fill_null(pc.greater_equal(ttl, limits.TTL_NEVER // timedelta(milliseconds=1)), False)
    ttl = pc.if_else(never, pa.scalar(None, pa.int64()), ttl)
    positive = pc.if_else(pc.greater(ttl, 0), ttl, pa.scalar(None, pa.int64()))
    return _set(rows, time_to_live_ms=ttl, expires_at_utc=limits.expiries(rows.column("enqueued_time_utc"), positive))


def _recompute_size(rows: pa.Table) -> pa.Table:
    """size_in_bytes as Message.size_in_bytes counts it: body, string properties and the properties' JSON."""
    total = pc.fill_null(pc.binary_length(rows.column("body")), 0).cast(pa.int64())
    for name in (*STRING_PROPERTY_COLUMNS, "application_properties"):
        total = pc.add(total, pc.fill_null(pc.binary_length(rows.column(name)), 0).cast(pa.int64()))
    return _set(rows, size_in_bytes=total)


def _strict_json(text: str) -> bool:
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError:
        return False
    return True


def _key_follows_session(original: pa.Table, acted: pa.Table) -> pa.Table:
    """Copies whose action set a new sys.SessionId but left sys.PartitionKey as sent: the key takes the new session id.

    The session id is the partition key (docs/semantics.md §3), so the key a sender gave follows the new id. The caller
    skips this for an action that sets sys.PartitionKey itself: that key stays as set (`_violations` refuses one that
    differs from the session id).
    """
    key, sid, old_sid = acted.column("partition_key"), acted.column("session_id"), original.column("session_id")
    moved = pc.and_(
        pc.coalesce(pc.not_equal(sid, old_sid), pc.is_valid(sid)),  # the action changed (or set) the session id ...
        pc.fill_null(pc.equal(key, original.column("partition_key")), False),  # ... and kept the sent key
    )
    if not pc.any(moved).as_py():
        return acted
    return with_columns(acted, partition_key=pc.if_else(moved, sid, key))


def _violations(rows: pa.Table, max_bytes: int) -> list[str | None]:
    """Per row: why the copy breaks a message invariant, or None."""
    out: list[str | None] = [None] * rows.num_rows
    sizes = rows.column("size_in_bytes").to_pylist()
    ttls = rows.column("time_to_live_ms").to_pylist()
    keys = {name: rows.column(name).to_pylist() for name in _KEY_COLUMNS}
    props = rows.column("application_properties").to_pylist()
    for i in range(rows.num_rows):
        if sizes[i] > max_bytes:
            out[i] = f"the rule action made the message {sizes[i]} bytes; at most {max_bytes} are allowed"
        elif keys["message_id"][i] is None or keys["message_id"][i] == "":
            out[i] = "the rule action removed the message id"
        elif any(v is not None and len(v) > limits.MAX_KEY_LENGTH for name in _KEY_COLUMNS for v in (keys[name][i],)):
            out[i] = f"the rule action set an id longer than {limits.MAX_KEY_LENGTH} characters"
        elif None not in (sid := keys["session_id"][i], key := keys["partition_key"][i]) and sid != key:
            # the session id is the partition key (docs/semantics.md §3): such a copy could never be sent on or resubmitted
            out[i] = f"the rule action made partition_key {key!r} differ from session_id {sid!r}"
        elif ttls[i] is not None and ttls[i] <= 0:
            out[i] = f"the rule action set sys.TimeToLive to {ttls[i]} ms; it must be positive"
        elif props[i] is not None and not _strict_json(props[i]):
            out[i] = "the rule action set a property to NaN or an infinity, which cannot be stored"
    return out


def _tag(rows: pa.Table, key: str) -> pa.Table:
    """Rows assigned to one subscription."""
    return with_columns(rows, subscription=constant(key, pa.string(), rows.num_rows))


def _cap_ttl(rows: pa.Table, sub: Subscriber) -> pa.Table:
    """Apply the subscription's default_message_time_to_live: a copy lives for the smaller of it and its own TTL."""
    ttl = sub.default_message_time_to_live
    if ttl is None:
        return rows
    cap_ms = ttl // timedelta(milliseconds=1)  # whole milliseconds, as every send stores a TTL (limits.ttl_ms)
    current = rows.column("time_to_live_ms")
    shorter = pc.fill_null(pc.less(pa.scalar(cap_ms, pa.int64()), current.cast(pa.int64())), True)
    capped_expiry = limits.expiries(rows.column("available_at_utc"), pa.scalar(cap_ms, pa.int64()))
    return with_columns(
        rows,
        time_to_live_ms=pc.if_else(shorter, pa.scalar(cap_ms, pa.int64()), current.cast(pa.int64())).cast(current.type),
        expires_at_utc=pc.if_else(shorter, capped_expiry.cast(TIMESTAMP), rows.column("expires_at_utc")),
    )


def without_markers(stored: pa.Table) -> pa.Table:
    """The stored rows that are messages: a topic send also stores its id records (ACCEPTED_MARKER)."""
    subs = stored.column("subscription")
    if subs.null_count == len(subs):  # a queue's rows: no markers, and no filter copying every column
        return stored
    return keep_rows(stored, pc.invert(pc.fill_null(pc.equal(subs, ACCEPTED_MARKER), False)))


def _markers(rows: pa.Table) -> pa.Table:
    """Completed, body-less rows that keep each accepted message id for duplicate detection."""
    out = _tag(rows, ACCEPTED_MARKER)
    n = out.num_rows
    return with_columns(
        out,
        state=constant(STATE_COMPLETED, pa.string(), n),
        available_at_utc=pa.nulls(n, TIMESTAMP),
        body=pa.nulls(n, pa.binary()),
        application_properties=pa.nulls(n, pa.string()),
    )
