"""Messages as users build and receive them, and their conversion to and from table rows (docs/semantics.md §2)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, MessageSizeExceededError
from sparkqueue.model import limits
from sparkqueue.model.ids import new_ids
from sparkqueue.model.lifecycle import scheduled_rows
from sparkqueue.model.partitioning import partition_key
from sparkqueue.storage.schema import (
    ENTITY_SCHEMA,
    KIND_MESSAGE,
    STATE_ACTIVE,
    STRING_PROPERTY_COLUMNS,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    constant,
)
from sparkqueue.storage.table import SEQUENCE_BITS

_ROW_SCHEMA = ENTITY_SCHEMA


def as_utc(value: object, field_name: str) -> datetime | None:
    """A timezone-aware UTC datetime; naive datetimes are read as UTC."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgumentTypeError(f"{field_name} must be a datetime, got {type(value).__name__}")
    try:  # a plain datetime, to the microsecond (pandas' Timestamp holds nanoseconds; its NaT has no fields)
        value = datetime(
            value.year, value.month, value.day, value.hour, value.minute, value.second, value.microsecond, value.tzinfo
        )
    except (TypeError, ValueError):
        raise InvalidOperationError(f"{field_name} must be a point in time, got {value!r}") from None
    try:
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidOperationError(f"{field_name} {value!r} lies outside the years 1-9999 in UTC") from None
    return min(utc, limits.LATEST_TIME)  # datetime.max ("never") is stored as the latest storable instant


def _body(value: object, field_name: str) -> bytes:
    """A body as stored: bytes; str as UTF-8; None as empty (the SDK's Message(body=None))."""
    if value is None:
        return b""
    if isinstance(value, str):
        return limits.check_utf8(value, field_name).encode("utf-8")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidArgumentTypeError(f"{field_name} must be bytes, str or None, got {type(value).__name__}")
    return bytes(value)


def _message_id(value: object, field_name: str) -> str | None:
    """A message id: None (assigned on send) or a non-empty string of at most 128 characters (a UUID is read as str)."""
    mid = limits.check_key(value, field_name)
    if mid == "":
        raise InvalidOperationError("message_id must not be empty (None lets sparkqueue assign one)")
    return mid


def _correlation_id(value: object, field_name: str) -> str | None:
    """A correlation id: None or a string (a uuid.UUID is read back as str)."""
    text = limits.as_id_string(value, field_name)
    return None if text is None else limits.check_utf8(text, field_name)


def _partition_key(value: object, session_id: str | None) -> str | None:
    """A partition key: as a message id, and equal to the session id when the message has one (the SDK's rule)."""
    key = limits.check_key(value, "partition_key")
    if key is not None and session_id is not None and key != session_id:
        raise InvalidOperationError(
            f"partition_key {key!r} cannot differ from session_id {session_id!r}: the session id is the partition key"
        )
    return key


def _properties(value: object, field_name: str) -> dict[str, Any] | None:
    """Checked application properties: the caller's dict itself (as the SDK keeps it), or a copy with bytes names decoded."""
    checked = limits.check_application_properties(value)
    return value if isinstance(value, dict) and all(isinstance(k, str) for k in value) else checked


def _text(value: object, field_name: str) -> str | None:
    """A string property (content_type, subject, to, reply_to, reply_to_session_id): None or a str with a UTF-8 form."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{field_name} must be a str, got {type(value).__name__}")
    return limits.check_utf8(value, field_name)


MESSAGE_FIELDS = (
    "body",
    "application_properties",
    "session_id",
    "message_id",
    "scheduled_enqueue_time_utc",
    "time_to_live",
    "content_type",
    "correlation_id",
    "subject",
    "partition_key",
    "to",
    "reply_to",
    "reply_to_session_id",
)


class Message:
    """A message to send (SDK: ServiceBusMessage): a body (bytes, str as UTF-8, or None) and broker properties.

    Ids may be given as the SDK accepts them (str, uuid.UUID, int, bytes) and read back as str. As
    in the SDK, a partition_key that differs from the session_id is refused when assigned. Every
    field is checked when it is assigned, at construction or later.
    """

    body: bytes
    message_id: str | None  # assigned on send when None
    session_id: str | None
    partition_key: str | None  # equal to session_id when both are set
    correlation_id: str | None
    application_properties: dict[str, Any] | None
    content_type: str | None
    subject: str | None
    to: str | None
    reply_to: str | None
    reply_to_session_id: str | None
    time_to_live: timedelta | None
    scheduled_enqueue_time_utc: datetime | None

    def __init__(
        self,
        body: bytes | str | None,
        *,
        message_id: str | None = None,
        session_id: str | None = None,
        partition_key: str | None = None,
        application_properties: dict[str, Any] | None = None,
        content_type: str | None = None,
        correlation_id: str | None = None,
        subject: str | None = None,
        to: str | None = None,
        reply_to: str | None = None,
        reply_to_session_id: str | None = None,
        time_to_live: timedelta | None = None,
        scheduled_enqueue_time_utc: datetime | None = None,
    ) -> None:
        # The same checks as __setattr__, written straight to the instance: construction is a send's hot path too.
        fields = self.__dict__
        fields["body"] = _body(body, "body")
        fields["application_properties"] = _properties(application_properties, "application_properties")
        fields["content_type"] = _text(content_type, "content_type")
        fields["subject"] = _text(subject, "subject")
        fields["to"] = _text(to, "to")
        fields["reply_to"] = _text(reply_to, "reply_to")
        fields["reply_to_session_id"] = _text(reply_to_session_id, "reply_to_session_id")
        fields["time_to_live"] = limits.check_ttl(time_to_live, "time_to_live")
        fields["scheduled_enqueue_time_utc"] = as_utc(scheduled_enqueue_time_utc, "scheduled_enqueue_time_utc")
        fields["message_id"] = _message_id(message_id, "message_id")
        fields["session_id"] = limits.check_key(session_id, "session_id")
        fields["partition_key"] = _partition_key(partition_key, fields["session_id"])
        fields["correlation_id"] = _correlation_id(correlation_id, "correlation_id")

    def __setattr__(self, name: str, value: object) -> None:
        """Check a field on every assignment (in the constructor or later), so a bad value is refused where it is set.

        Reads stay plain attribute lookups: a send reads every field of every message.
        """
        if name == "partition_key":
            value = _partition_key(value, self.session_id)
        else:
            check = _FIELD_CHECKS.get(name)
            value = value if check is None else check(value, name)
        object.__setattr__(self, name, value)

    def __str__(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Message(message_id={self.message_id!r}, body={self.body[:40]!r})"

    @property
    def size_in_bytes(self) -> int:
        """Body plus properties, as the size limits count it."""
        strings = (
            self.message_id,
            self.session_id,
            self.partition_key,
            self.content_type,
            self.correlation_id,
            self.subject,
            self.to,
            self.reply_to,
            self.reply_to_session_id,
        )
        props = properties_json(self.application_properties, strict=False) if self.application_properties else ""
        return len(self.body) + sum(len(s.encode("utf-8")) for s in strings if s) + len(props.encode("utf-8"))


# The checks Message.__setattr__ applies (partition_key's also reads session_id: _partition_key).
_FIELD_CHECKS: dict[str, Callable[[object, str], Any]] = {
    "body": _body,
    "message_id": _message_id,
    "session_id": limits.check_key,
    "correlation_id": _correlation_id,
    "application_properties": _properties,
    "content_type": _text,
    "subject": _text,
    "to": _text,
    "reply_to": _text,
    "reply_to_session_id": _text,
    "time_to_live": limits.check_ttl,
    "scheduled_enqueue_time_utc": as_utc,
}


def message_label(message_id: str | None) -> str:
    """How an error names a message: by its id, or as "a message" when it has none (an id it would be given means nothing)."""
    return f"message {message_id!r}" if message_id is not None else "a message"


def as_message(value: object) -> Message:
    """A Message to send from a Message, a received message (sent again) or a dict of Message keywords (as the SDK)."""
    if isinstance(value, Message):
        return value
    if isinstance(value, ReceivedMessage):
        return Message(
            value.body,
            message_id=value.message_id,
            session_id=value.session_id,
            partition_key=value.partition_key,
            application_properties=_user_properties(value),
            content_type=value.content_type,
            correlation_id=value.correlation_id,
            subject=value.subject,
            to=value.to,
            reply_to=value.reply_to,
            reply_to_session_id=value.reply_to_session_id,
            time_to_live=value.time_to_live,
        )
    if isinstance(value, Mapping):
        unknown = set(value) - set(MESSAGE_FIELDS)
        if unknown:
            raise InvalidArgumentTypeError(f"unknown Message field(s) in dict: {', '.join(sorted(map(str, unknown)))}")
        return Message(**{k: v for k, v in value.items() if k != "body"}, body=value.get("body"))
    raise InvalidArgumentTypeError(
        f"expected a Message, a received message or a dict of Message fields, got {type(value).__name__}"
    )


DEAD_LETTER_REASON_PROPERTY = "DeadLetterReason"
DEAD_LETTER_DESCRIPTION_PROPERTY = "DeadLetterErrorDescription"


def _user_properties(message: ReceivedMessage) -> dict[str, Any] | None:
    """A received message's application properties without the broker's dead-letter annotations (a dead letter's only:
    a message never dead-lettered keeps properties of those names that its sender set)."""
    props = message.application_properties
    if not props:
        return None
    if message.dead_letter_reason is None and message.dead_letter_error_description is None:
        return dict(props)
    return {k: v for k, v in props.items() if k not in (DEAD_LETTER_REASON_PROPERTY, DEAD_LETTER_DESCRIPTION_PROPERTY)}


class ApplicationProperties(dict[str, Any]):
    """Received application properties: str keys, also looked up by the bytes keys the SDK hands out (props[b"k"])."""

    @staticmethod
    def _key(key: object) -> Any:
        if isinstance(key, (bytes, bytearray)):
            try:
                return bytes(key).decode("utf-8")
            except UnicodeDecodeError:
                return key
        return key

    def __getitem__(self, key: object) -> Any:
        return super().__getitem__(self._key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: object, default: Any = None) -> Any:
        """As dict.get, accepting bytes keys."""
        return super().get(self._key(key), default)


@dataclass
class ReceivedMessage:
    """A delivered (or peeked) message with its broker-assigned properties."""

    body: bytes
    message_id: str
    sequence_number: int
    enqueued_time_utc: datetime
    delivery_count: int
    partition_id: int
    state: str
    lock_token: str | None = None
    locked_until_utc: datetime | None = None
    expires_at_utc: datetime | None = None
    session_id: str | None = None
    partition_key: str | None = None
    application_properties: dict[str, Any] | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    subject: str | None = None
    to: str | None = None
    reply_to: str | None = None
    reply_to_session_id: str | None = None
    time_to_live: timedelta | None = None
    scheduled_enqueue_time_utc: datetime | None = None
    dead_letter_reason: str | None = None
    dead_letter_error_description: str | None = None
    dead_letter_source: str | None = None
    size_in_bytes: int = 0
    _settled: bool = field(default=False, repr=False)
    _settling: bool = field(default=False, repr=False, compare=False)
    auto_renew_error: BaseException | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def __hash__(self) -> int:
        """Hashable like the SDK's message (sets, dict keys), on what equal messages share and no settle or renewal changes."""
        return hash((self.message_id, self.sequence_number))


def is_settled(message: object) -> bool:
    """Whether a receiver settled this received message (its lock then needs no renewal, and a second settle is refused)."""
    return bool(getattr(message, "_settled", False))


def mark_settled(message: ReceivedMessage) -> None:
    """Record that the message was settled (by the receiver holding it)."""
    message._settled = True


def is_settling(message: object) -> bool:
    """Whether a settlement of this message is in flight: a renewal failing meanwhile lost the lock to it, not to expiry."""
    return bool(getattr(message, "_settling", False))


def mark_settling(messages: Sequence[ReceivedMessage], settling: bool) -> None:
    """Record the start (or end) of a settlement of these messages by the receiver holding them."""
    for m in messages:
        m._settling = settling


def lock_expired(locked_until_utc: datetime | None) -> bool:
    """True once a lock (a message's or a session's) has passed its expiry, or when there is none."""
    return locked_until_utc is None or locked_until_utc <= datetime.now(UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _pylist(col: pa.ChunkedArray) -> list[Any]:
    """A column as Python values; timestamps through int64 (several times cheaper than pyarrow's tz-aware path)."""
    n = len(col)
    if col.null_count == n:
        return [None] * n
    if pa.types.is_timestamp(col.type):
        # Rows of one send or one lock share their timestamps: convert each distinct value once.
        seen: dict[int, datetime] = {}
        return [
            None if us is None else seen.get(us) or seen.setdefault(us, _EPOCH + timedelta(microseconds=us))
            for us in col.cast(pa.int64()).to_pylist()
        ]
    values: list[Any] = col.to_pylist()
    return values


def received_messages(rows: pa.Table, now: datetime) -> list[ReceivedMessage]:
    """Build ReceivedMessage objects from entity rows.

    Column-wise: the per-row rules (scheduled state, the reported delivery count, the partition)
    are Arrow expressions, and each object gets its attributes in one dict update; building
    1,000 messages this way costs a fraction of 1,000 dataclass constructions.
    """
    n = rows.num_rows
    if n == 0:
        return []
    now_ts = pa.scalar(now, TIMESTAMP)
    state = rows.column("state")
    scheduled = scheduled_rows(rows, now)
    counts = rows.column("delivery_count")
    # The SDK's delivery_count counts deliveries that ended; the stored one includes a live lock's (reported_delivery_count).
    live = pc.fill_null(
        pc.and_(
            pc.and_(pc.is_valid(rows.column("lock_token")), pc.greater(rows.column("locked_until_utc"), now_ts)),
            pc.greater(counts, 0),
        ),
        False,
    )
    c = {name: _pylist(col) for name, col in zip(rows.column_names, rows.columns, strict=True)}
    ttls = c["time_to_live_ms"]
    reasons, descriptions = c["dead_letter_reason"], c["dead_letter_error_description"]
    props = c["application_properties"]
    if any(rows.column(name).null_count < n for name in ("application_properties", *_DEAD_LETTER_COLUMNS)):
        props = [_received_properties(*v) for v in zip(props, reasons, descriptions, strict=True)]
    columns: dict[str, list[Any]] = {
        **{name: c[name] for name in _RECEIVED_COLUMNS},
        "body": [b or b"" for b in c["body"]],
        "delivery_count": _pylist(pc.if_else(live, pc.subtract(counts, 1), counts)),
        "partition_id": _pylist(pc.shift_right(rows.column("sequence_number"), SEQUENCE_BITS)),
        "state": _pylist(pc.if_else(scheduled, "scheduled", state)),
        "application_properties": props,
        "time_to_live": [None if ms is None else timedelta(milliseconds=ms) for ms in ttls],
    }
    names = tuple(columns)
    new = object.__new__
    out = []
    for values in zip(*columns.values(), strict=True):
        m = new(ReceivedMessage)
        m.__dict__.update(zip(names, values, strict=True), _settled=False, _settling=False, auto_renew_error=None)
        out.append(m)
    return out


_DEAD_LETTER_COLUMNS = ("dead_letter_reason", "dead_letter_error_description")
# Received-message fields copied as stored (the others are computed in received_messages).
_RECEIVED_COLUMNS = (
    *STRING_PROPERTY_COLUMNS,
    "sequence_number",
    "enqueued_time_utc",
    "lock_token",
    "locked_until_utc",
    "expires_at_utc",
    "scheduled_enqueue_time_utc",
    *_DEAD_LETTER_COLUMNS,
    "dead_letter_source",
    "size_in_bytes",
)


def reported_delivery_count(stored: int, lock_token: str | None, locked_until: datetime | None, now: datetime) -> int:
    """The SDK's delivery_count: deliveries that ended (lock expired, abandoned, ...), not the one in progress.

    The stored count includes a delivery as soon as it locks the message, so a row whose lock is
    live reports one less; 0 on the first delivery, as the Python SDK reports it.
    """
    live = lock_token is not None and locked_until is not None and locked_until > now
    return stored - 1 if live and stored > 0 else stored


def _received_properties(text: str | None, reason: str | None, description: str | None) -> ApplicationProperties | None:
    """Stored properties as a received message shows them; a dead letter also carries its reason and description
    as DeadLetterReason and DeadLetterErrorDescription, as Service Bus records them (over properties of those names
    that its sender set, as Service Bus overwrites them)."""
    props = ApplicationProperties(json.loads(text)) if text else None
    if reason is not None or description is not None:
        props = props if props is not None else ApplicationProperties()
        if reason is not None:
            props[DEAD_LETTER_REASON_PROPERTY] = reason
        if description is not None:
            props[DEAD_LETTER_DESCRIPTION_PROPERTY] = description
    return props


@dataclass(frozen=True)
class SendSettings:
    """The entity settings a send obeys."""

    tier: str
    requires_duplicate_detection: bool
    requires_session: bool
    default_message_time_to_live: timedelta | None


def send_settings(tier: str, props: object) -> SendSettings:
    """The entity settings that govern a send."""
    return SendSettings(
        tier=tier,
        requires_duplicate_detection=getattr(props, "requires_duplicate_detection", False),
        requires_session=getattr(props, "requires_session", False),
        default_message_time_to_live=getattr(props, "default_message_time_to_live", None),
    )


def to_rows(messages: Iterable[Message], settings: SendSettings, now: datetime) -> tuple[pa.Table, list[str | None]]:
    """Validate messages and turn them into rows (no partition or sequence yet) plus each one's partition key.

    Built column by column, with the common case (no schedule, no TTL) as constant columns: a
    per-message loop with a dozen calls each cost more than the rest of a 1,000-message send.
    """
    msgs = list(messages)
    for m in msgs:
        if not isinstance(m, Message):
            raise InvalidArgumentTypeError(f"expected Message, got {type(m).__name__}")
    sessions = [m.session_id for m in msgs]
    if settings.requires_session and None in sessions:
        raise InvalidOperationError("the entity requires sessions: every message needs a session_id")
    given = [m.message_id for m in msgs]
    fresh = iter(new_ids(given.count(None)))
    mids = [g if g is not None else next(fresh) for g in given]
    props = [properties_json(m.application_properties) if m.application_properties else None for m in msgs]
    strings = {
        "session_id": sessions,
        **{name: [getattr(m, name) for m in msgs] for name in _OTHER_STRING_COLUMNS},
    }
    bodies = pa.array([m.body for m in msgs], pa.binary())
    sizes = _sizes(bodies, [pa.array(given, pa.string()), *(pa.array(v, pa.string()) for v in strings.values())], props)
    _check_sizes(sizes, mids, settings.tier)
    keys = _partition_keys(strings["session_id"], strings["partition_key"], mids, settings.requires_duplicate_detection)
    ttls = [limits.ttl_ms(m.time_to_live) for m in msgs]
    scheduled = [m.scheduled_enqueue_time_utc for m in msgs]
    columns = {
        "message_id": pa.array(mids, pa.string()),
        "body": bodies,
        **{name: pa.array(values, pa.string()) for name, values in strings.items()},
        "application_properties": pa.array(props, pa.string()),
        "size_in_bytes": sizes,
        "time_to_live_ms": _optional(ttls, pa.int64()),
        "scheduled_enqueue_time_utc": _optional(scheduled, TIMESTAMP),
    }
    return message_rows(columns, len(msgs), settings.default_message_time_to_live, now), keys


def properties_json(props: dict[str, Any], *, strict: bool = True) -> str:
    """Application properties as JSON; `strict` checks them again, as a send does (the dict may have changed since).

    Not strict (a size estimate), a value JSON cannot hold still raises the check's clear error.
    """
    if not strict:
        try:
            return json.dumps(props, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    # UTF-8 as it is, not \u escapes: a size counts 3 bytes for "€", not 6 (as Spark's to_json writes it too)
    return json.dumps(limits.check_application_properties(props), allow_nan=False, ensure_ascii=False)


def message_rows(
    columns: Mapping[str, pa.Array | pa.ChunkedArray],
    n: int,
    default_ttl: timedelta | None,
    now: datetime,
    partition: pa.Array | pa.ChunkedArray | None = None,
) -> pa.Table:
    """Entity rows (ENTITY_SCHEMA) of validated message columns, enqueued `now`: the one row conversion of every send.

    `columns` holds `n` rows of message columns named as in ENTITY_SCHEMA (message_id filled in, body, the
    string properties, application_properties as JSON, size_in_bytes, time_to_live_ms,
    scheduled_enqueue_time_utc); absent ones are null. Both `to_rows` and Spark's send tasks
    call it, so a message is stored the same whichever path sent it. A scheduled message is
    enqueued when it becomes visible (as in Service Bus), so expires_at_utc == enqueued_time_utc +
    time to live holds for it too (docs/semantics.md §5); the entity's default TTL caps the message's.
    """
    ttl = _column(columns, n, "time_to_live_ms", pa.int64())
    if default_ttl is not None:
        ttl = pc.min_element_wise(ttl, pa.scalar(limits.ttl_ms(default_ttl), pa.int64()))
    scheduled = _column(columns, n, "scheduled_enqueue_time_utc", TIMESTAMP)
    if ttl.null_count == n and scheduled.null_count == n:  # the common case: constant columns
        visible, expires = constant(now, TIMESTAMP, n), pa.nulls(n, TIMESTAMP)
    else:
        visible = limits.visible_at(scheduled, now)
        expires = limits.expiries(visible, ttl)
    cols: dict[str, Any] = {
        "partition_id": constant(0, pa.int32(), n) if partition is None else partition,
        "sequence_number": constant(0, pa.int64(), n),
        "available_at_utc": visible,
        "sub_queue": constant(SUB_QUEUE_MAIN, pa.string(), n),
        "state": constant(STATE_ACTIVE, pa.string(), n),
        "kind": constant(KIND_MESSAGE, pa.string(), n),
        "enqueued_time_utc": visible,
        "expires_at_utc": expires,
        "scheduled_enqueue_time_utc": scheduled,
        "delivery_count": constant(0, pa.int32(), n),
        "time_to_live_ms": ttl,
        "transfer_hop_count": constant(0, pa.int32(), n),
    }
    arrays = [cols[f.name] if f.name in cols else _column(columns, n, f.name, f.type) for f in _ROW_SCHEMA]
    return pa.Table.from_arrays([_typed(a, f.type) for a, f in zip(arrays, _ROW_SCHEMA, strict=True)], schema=_ROW_SCHEMA)


def _column(columns: Mapping[str, Any], n: int, name: str, type_: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """One column as `type_` (chunks kept: no copy); n nulls when there is none."""
    values = columns.get(name)
    return pa.nulls(n, type_) if values is None else _typed(values, type_)


def _typed(values: Any, type_: pa.DataType) -> Any:
    """`values` as `type_` (a cast only when the type differs: casts cost a compute call each)."""
    return values if values.type == type_ else values.cast(type_)


def _optional(values: list[Any], type_: pa.DataType) -> pa.Array:
    """A column of optional per-message values; all-null cheaply when no message sets one."""
    return pa.nulls(len(values), type_) if all(v is None for v in values) else pa.array(values, type_)


# The string properties after message_id and session_id (which a send reads first).
_OTHER_STRING_COLUMNS = tuple(c for c in STRING_PROPERTY_COLUMNS if c not in ("message_id", "session_id"))


def _sizes(bodies: pa.Array, strings: list[pa.Array], props: list[str | None]) -> pa.Array:
    """Each message's size_in_bytes (body, UTF-8 string properties, JSON properties), as Message.size_in_bytes counts it."""
    total = pc.binary_length(bodies).cast(pa.int64())
    for col in [*strings, pa.array(props, pa.string())]:
        if col.null_count < len(col):
            total = pc.add(total, pc.fill_null(pc.binary_length(col), 0).cast(pa.int64()))
    return total


def _check_sizes(sizes: pa.Array, mids: list[str], tier: str) -> None:
    """MessageSizeExceededError naming the first message larger than the tier allows."""
    max_bytes = limits.MAX_MESSAGE_BYTES[tier]
    if len(sizes) == 0 or (pc.max(sizes).as_py() or 0) <= max_bytes:
        return
    i = pc.index(pc.greater(sizes, max_bytes), True).as_py()
    raise MessageSizeExceededError(f"message {mids[i]!r} is {sizes[i].as_py()} bytes; the {tier} tier allows {max_bytes}")


def _partition_keys(sessions: list[str | None], pkeys: list[str | None], mids: list[str], dedupe: bool) -> list[str | None]:
    """Each message's partition key (docs/semantics.md §3); all None, cheaply, for unkeyed sends."""
    if not dedupe and all(s is None for s in sessions) and all(k is None for k in pkeys):
        return [None] * len(mids)
    return [partition_key(s, k, mid, dedupe) for s, k, mid in zip(sessions, pkeys, mids, strict=True)]


class MessageBatch:
    """Messages that fit one send (SDK: ServiceBusMessageBatch); add_message raises when one would not fit."""

    def __init__(self, max_size_in_bytes: int, max_message_bytes: int | None = None) -> None:
        self.max_size_in_bytes = max_size_in_bytes
        self.max_message_bytes = max_message_bytes or max_size_in_bytes
        self._messages: list[Message] = []
        self._size = 0

    def add_message(self, message: Message | ReceivedMessage | Mapping[str, Any]) -> None:
        """Add a message (or a received one, or a dict of Message fields); MessageSizeExceededError if it does not fit."""
        message = as_message(message)
        size = message.size_in_bytes
        if size > self.max_message_bytes:
            raise MessageSizeExceededError(f"message of {size} bytes is larger than the tier allows ({self.max_message_bytes})")
        if self._size + size > self.max_size_in_bytes:
            raise MessageSizeExceededError(
                f"message of {size} bytes does not fit: the batch holds {self._size} of {self.max_size_in_bytes} bytes"
            )
        self._messages.append(message)
        self._size += size

    @property
    def size_in_bytes(self) -> int:
        """Bytes used so far."""
        return self._size

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)
