"""Messages as users build and receive them, and their conversion to and from table rows (docs/semantics.md §2)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, MessageSizeExceededError
from sparkqueue.model import limits
from sparkqueue.model.ids import new_ids
from sparkqueue.model.partitioning import partition_key
from sparkqueue.storage.schema import (
    ENTITY_SCHEMA,
    KIND_MESSAGE,
    STATE_ACTIVE,
    SUB_QUEUE_MAIN,
)

_ROW_SCHEMA = ENTITY_SCHEMA


def as_utc(value: object, field_name: str) -> datetime | None:
    """A timezone-aware UTC datetime; naive datetimes are read as UTC."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgumentTypeError(f"{field_name} must be a datetime, got {type(value).__name__}")
    try:
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidOperationError(f"{field_name} {value!r} lies outside the years 1-9999 in UTC") from None
    return min(utc, limits.LATEST_TIME)  # datetime.max ("never") is stored as the latest storable instant


_STRING_FIELDS = ("content_type", "subject", "to", "reply_to", "reply_to_session_id")
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
    in the SDK, a partition_key that differs from the session_id is refused when assigned.
    """

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
        if body is None:
            body = b""
        if isinstance(body, str):
            body = limits.check_utf8(body, "body").encode("utf-8")
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise InvalidArgumentTypeError(f"body must be bytes, str or None, got {type(body).__name__}")
        self.body = bytes(body)
        self.message_id = message_id
        self._session_id: str | None = None
        self._partition_key: str | None = None
        self.session_id = session_id
        self.partition_key = partition_key
        self.application_properties = limits.check_application_properties(application_properties)
        self.correlation_id = correlation_id
        for name, value in (
            ("content_type", content_type),
            ("subject", subject),
            ("to", to),
            ("reply_to", reply_to),
            ("reply_to_session_id", reply_to_session_id),
        ):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentTypeError(f"{name} must be a str, got {type(value).__name__}")
            setattr(self, name, None if value is None else limits.check_utf8(value, name))
        self.content_type: str | None
        self.subject: str | None
        self.to: str | None
        self.reply_to: str | None
        self.reply_to_session_id: str | None
        self.time_to_live = limits.check_ttl(time_to_live, "time_to_live")
        self.scheduled_enqueue_time_utc = as_utc(scheduled_enqueue_time_utc, "scheduled_enqueue_time_utc")

    @property
    def message_id(self) -> str | None:
        """The message id (at most 128 characters); assigned on send when None."""
        return self._message_id

    @message_id.setter
    def message_id(self, value: object) -> None:
        mid = limits.check_key(value, "message_id")
        if mid == "":
            raise InvalidOperationError("message_id must not be empty (None lets sparkqueue assign one)")
        self._message_id = mid

    @property
    def correlation_id(self) -> str | None:
        """The correlation id (a uuid.UUID is read back as str)."""
        return self._correlation_id

    @correlation_id.setter
    def correlation_id(self, value: object) -> None:
        text = limits.as_id_string(value, "correlation_id")
        self._correlation_id = None if text is None else limits.check_utf8(text, "correlation_id")

    @property
    def session_id(self) -> str | None:
        """The session the message belongs to (at most 128 characters)."""
        return self._session_id

    @session_id.setter
    def session_id(self, value: object) -> None:
        self._session_id = limits.check_key(value, "session_id")

    @property
    def partition_key(self) -> str | None:
        """The partition key; when the message has a session_id it must be equal to it (ValueError otherwise)."""
        return self._partition_key

    @partition_key.setter
    def partition_key(self, value: object) -> None:
        key = limits.check_key(value, "partition_key")
        if key is not None and self._session_id is not None and key != self._session_id:
            raise InvalidOperationError(
                f"partition_key {key!r} cannot differ from session_id {self._session_id!r}: the session id is the partition key"
            )
        self._partition_key = key

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
        props = json.dumps(self.application_properties) if self.application_properties else ""
        return len(self.body) + sum(len(s.encode("utf-8")) for s in strings if s) + len(props.encode("utf-8"))


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
            application_properties=_user_properties(value.application_properties),
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


def _user_properties(props: dict[str, Any] | None) -> dict[str, Any] | None:
    """A received message's application properties without the broker's dead-letter annotations."""
    if not props:
        return None
    return {k: v for k, v in props.items() if k not in (DEAD_LETTER_REASON_PROPERTY, DEAD_LETTER_DESCRIPTION_PROPERTY)}


class ApplicationProperties(dict[str, Any]):
    """Received application properties: str keys, also looked up by the bytes keys the SDK hands out (props[b"k"])."""

    @staticmethod
    def _key(key: object) -> object:
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

    def get(self, key: object, default: Any = None) -> Any:  # type: ignore[override]
        """As dict.get, accepting bytes keys."""
        return super().get(self._key(key), default)  # type: ignore[call-overload]


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
    auto_renew_error: BaseException | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    @property
    def _lock_expired(self) -> bool:
        """True once the message's lock has passed its expiry (or it holds none)."""
        return self.locked_until_utc is None or self.locked_until_utc <= datetime.now(UTC)


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
    return col.to_pylist()


def received_messages(rows: pa.Table, now: datetime) -> list[ReceivedMessage]:
    """Build ReceivedMessage objects from entity rows (column-wise: far cheaper than per-row dicts)."""
    c = {name: _pylist(col) for name, col in zip(rows.column_names, rows.columns, strict=True)}
    out = []
    for i, seq in enumerate(c["sequence_number"]):
        sched = c["scheduled_enqueue_time_utc"][i]
        state = c["state"][i]
        if state == STATE_ACTIVE and sched is not None and sched > now:
            state = "scheduled"
        ttl = c["time_to_live_ms"][i]
        props = _received_properties(
            c["application_properties"][i], c["dead_letter_reason"][i], c["dead_letter_error_description"][i]
        )
        out.append(
            ReceivedMessage(
                body=c["body"][i] or b"",
                message_id=c["message_id"][i],
                sequence_number=seq,
                enqueued_time_utc=c["enqueued_time_utc"][i],
                delivery_count=reported_delivery_count(c["delivery_count"][i], c["lock_token"][i], c["locked_until_utc"][i], now),
                partition_id=seq >> 48,
                state=state,
                lock_token=c["lock_token"][i],
                locked_until_utc=c["locked_until_utc"][i],
                expires_at_utc=c["expires_at_utc"][i],
                session_id=c["session_id"][i],
                partition_key=c["partition_key"][i],
                application_properties=props,
                content_type=c["content_type"][i],
                correlation_id=c["correlation_id"][i],
                subject=c["subject"][i],
                to=c["to"][i],
                reply_to=c["reply_to"][i],
                reply_to_session_id=c["reply_to_session_id"][i],
                time_to_live=timedelta(milliseconds=ttl) if ttl is not None else None,
                scheduled_enqueue_time_utc=sched,
                dead_letter_reason=c["dead_letter_reason"][i],
                dead_letter_error_description=c["dead_letter_error_description"][i],
                dead_letter_source=c["dead_letter_source"][i],
                size_in_bytes=c["size_in_bytes"][i],
            )
        )
    return out


def reported_delivery_count(stored: int, lock_token: str | None, locked_until: datetime | None, now: datetime) -> int:
    """The SDK's delivery_count: deliveries that ended (lock expired, abandoned, ...), not the one in progress.

    The stored count includes a delivery as soon as it locks the message, so a row whose lock is
    live reports one less; 0 on the first delivery, as the Python SDK reports it.
    """
    live = lock_token is not None and locked_until is not None and locked_until > now
    return stored - 1 if live and stored > 0 else stored


def _received_properties(text: str | None, reason: str | None, description: str | None) -> ApplicationProperties | None:
    """Stored properties as a received message shows them; a dead letter also carries its reason and description
    as DeadLetterReason and DeadLetterErrorDescription, as Service Bus records them."""
    props = ApplicationProperties(json.loads(text)) if text else None
    if reason is not None or description is not None:
        props = props if props is not None else ApplicationProperties()
        if reason is not None:
            props.setdefault(DEAD_LETTER_REASON_PROPERTY, reason)
        if description is not None:
            props.setdefault(DEAD_LETTER_DESCRIPTION_PROPERTY, description)
    return props


@dataclass(frozen=True)
class SendSettings:
    """The entity settings a send obeys."""

    tier: str
    requires_duplicate_detection: bool
    requires_session: bool
    default_message_time_to_live: timedelta | None


def to_rows(messages: Iterable[Message], settings: SendSettings, now: datetime) -> tuple[pa.Table, list[str | None]]:
    """Validate messages and turn them into rows (no partition or sequence yet) plus each one's partition key."""
    msgs = list(messages)
    max_bytes = limits.MAX_MESSAGE_BYTES[settings.tier]
    keys: list[str | None] = []
    ids = new_ids(sum(1 for m in msgs if isinstance(m, Message) and m.message_id is None))
    visible, expires, ttls, sizes, mids, props = [], [], [], [], [], []
    for m in msgs:
        if not isinstance(m, Message):
            raise InvalidArgumentTypeError(f"expected Message, got {type(m).__name__}")
        if settings.requires_session and m.session_id is None:
            raise InvalidOperationError("the entity requires sessions: every message needs a session_id")
        size = m.size_in_bytes
        if size > max_bytes:
            raise MessageSizeExceededError(
                f"message {m.message_id!r} is {size} bytes; the {settings.tier} tier allows {max_bytes}"
            )
        mid = m.message_id if m.message_id is not None else ids.pop()
        keys.append(partition_key(m.session_id, m.partition_key, mid, settings.requires_duplicate_detection))
        ttl = min((t for t in (m.time_to_live, settings.default_message_time_to_live) if t is not None), default=None)
        at = max(now, m.scheduled_enqueue_time_utc) if m.scheduled_enqueue_time_utc else now
        visible.append(at)
        expires.append(limits.expiry(at, ttl))
        ttls.append(limits.ttl_ms(ttl))
        sizes.append(size)
        mids.append(mid)
        props.append(json.dumps(m.application_properties) if m.application_properties else None)
    n = len(msgs)

    def attr(name: str) -> list[Any]:
        return [getattr(m, name) for m in msgs]

    cols: dict[str, Any] = {
        "partition_id": pa.nulls(n, pa.int32()).fill_null(0),
        "sequence_number": pa.nulls(n, pa.int64()).fill_null(0),
        "available_at_utc": visible,
        "sub_queue": pa.array([SUB_QUEUE_MAIN] * n),
        "state": pa.array([STATE_ACTIVE] * n),
        "kind": pa.array([KIND_MESSAGE] * n),
        # A scheduled message is enqueued when it becomes visible (as in Service Bus), so that
        # expires_at_utc == enqueued_time_utc + ttl holds for it too (docs/semantics.md §5).
        "enqueued_time_utc": pa.array(visible, _ROW_SCHEMA.field("enqueued_time_utc").type),
        "expires_at_utc": expires,
        "scheduled_enqueue_time_utc": attr("scheduled_enqueue_time_utc"),
        "delivery_count": pa.nulls(n, pa.int32()).fill_null(0),
        "message_id": mids,
        "time_to_live_ms": ttls,
        "size_in_bytes": sizes,
        "transfer_hop_count": pa.nulls(n, pa.int32()).fill_null(0),
        "application_properties": props,
        "body": attr("body"),
    }
    for name in (
        "session_id",
        "partition_key",
        "correlation_id",
        "subject",
        "to",
        "reply_to",
        "reply_to_session_id",
        "content_type",
    ):
        cols[name] = attr(name)
    arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in _ROW_SCHEMA]
    return pa.Table.from_arrays(
        [pa.array(a, f.type) if not isinstance(a, pa.Array) else a for a, f in zip(arrays, _ROW_SCHEMA, strict=True)],
        schema=_ROW_SCHEMA,
    ), keys


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
