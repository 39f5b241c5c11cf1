"""Messages as users build and receive them, and their conversion to and from table rows (SPEC §2)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from sparkqueue.errors import InvalidOperationError, MessageSizeExceededError
from sparkqueue.model import limits
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
        raise InvalidOperationError(f"{field_name} must be a datetime, got {type(value).__name__}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Message:
    """A message to send: a body (bytes or str, stored as UTF-8) and broker properties."""

    def __init__(
        self,
        body: bytes | str,
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
        if isinstance(body, str):
            body = body.encode("utf-8")
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise InvalidOperationError(f"body must be bytes or str, got {type(body).__name__}")
        self.body = bytes(body)
        self.message_id = limits.check_key(message_id, "message_id")
        self.session_id = limits.check_key(session_id, "session_id")
        self.partition_key = limits.check_key(partition_key, "partition_key")
        self.application_properties = limits.check_application_properties(application_properties)
        for name, value in (("content_type", content_type), ("correlation_id", correlation_id), ("subject", subject),
                            ("to", to), ("reply_to", reply_to), ("reply_to_session_id", reply_to_session_id)):
            if value is not None and not isinstance(value, str):
                raise InvalidOperationError(f"{name} must be a str, got {type(value).__name__}")
        self.content_type = content_type
        self.correlation_id = correlation_id
        self.subject = subject
        self.to = to
        self.reply_to = reply_to
        self.reply_to_session_id = reply_to_session_id
        self.time_to_live = limits.check_duration(time_to_live, "time_to_live", allow_none=True)
        self.scheduled_enqueue_time_utc = as_utc(scheduled_enqueue_time_utc, "scheduled_enqueue_time_utc")

    def __str__(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Message(message_id={self.message_id!r}, body={self.body[:40]!r})"

    @property
    def size_in_bytes(self) -> int:
        """Body plus properties, as the size limits count it."""
        strings = (self.message_id, self.session_id, self.partition_key, self.content_type, self.correlation_id,
                   self.subject, self.to, self.reply_to, self.reply_to_session_id)
        props = json.dumps(self.application_properties) if self.application_properties else ""
        return len(self.body) + sum(len(s.encode("utf-8")) for s in strings if s) + len(props.encode("utf-8"))


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

    def __str__(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def received_messages(rows: pa.Table, now: datetime) -> list[ReceivedMessage]:
    """Build ReceivedMessage objects from entity rows."""
    out = []
    for r in rows.to_pylist():
        seq = r["sequence_number"]
        sched = r["scheduled_enqueue_time_utc"]
        state = r["state"]
        if state == STATE_ACTIVE and sched is not None and sched > now:
            state = "scheduled"
        ttl = r["time_to_live_ms"]
        props = r["application_properties"]
        out.append(ReceivedMessage(
            body=r["body"] or b"", message_id=r["message_id"], sequence_number=seq,
            enqueued_time_utc=r["enqueued_time_utc"], delivery_count=r["delivery_count"],
            partition_id=seq >> 48, state=state, lock_token=r["lock_token"], locked_until_utc=r["locked_until_utc"],
            expires_at_utc=r["expires_at_utc"], session_id=r["session_id"], partition_key=r["partition_key"],
            application_properties=json.loads(props) if props else None, content_type=r["content_type"],
            correlation_id=r["correlation_id"], subject=r["subject"], to=r["to"], reply_to=r["reply_to"],
            reply_to_session_id=r["reply_to_session_id"], time_to_live=timedelta(milliseconds=ttl) if ttl is not None else None,
            scheduled_enqueue_time_utc=sched, dead_letter_reason=r["dead_letter_reason"],
            dead_letter_error_description=r["dead_letter_error_description"], dead_letter_source=r["dead_letter_source"],
            size_in_bytes=r["size_in_bytes"],
        ))
    return out


@dataclass(frozen=True)
class SendSettings:
    """The entity settings a send obeys."""

    tier: str
    requires_duplicate_detection: bool
    requires_session: bool
    default_message_time_to_live: timedelta | None


def to_rows(messages: Iterable[Message], settings: SendSettings, now: datetime) -> tuple[pa.Table, list[str | None]]:
    """Validate messages and turn them into rows (no partition or sequence yet) plus each one's partition key."""
    cols: dict[str, list[Any]] = {name: [] for name in _ROW_SCHEMA.names}
    keys: list[str | None] = []
    max_bytes = limits.MAX_MESSAGE_BYTES[settings.tier]
    for m in messages:
        if not isinstance(m, Message):
            raise InvalidOperationError(f"expected Message, got {type(m).__name__}")
        if settings.requires_session and m.session_id is None:
            raise InvalidOperationError("the entity requires sessions: every message needs a session_id")
        size = m.size_in_bytes
        if size > max_bytes:
            raise MessageSizeExceededError(
                f"message {m.message_id!r} is {size} bytes; the {settings.tier} tier allows {max_bytes}"
            )
        mid = m.message_id or str(uuid.uuid4())
        keys.append(partition_key(m.session_id, m.partition_key, mid, settings.requires_duplicate_detection))
        ttl = min((t for t in (m.time_to_live, settings.default_message_time_to_live) if t is not None), default=None)
        visible = max(now, m.scheduled_enqueue_time_utc) if m.scheduled_enqueue_time_utc else now
        row = {
            "partition_id": 0, "sequence_number": 0, "available_at_utc": visible, "sub_queue": SUB_QUEUE_MAIN,
            "state": STATE_ACTIVE, "kind": KIND_MESSAGE, "enqueued_time_utc": now,
            "expires_at_utc": visible + ttl if ttl is not None else None,
            "scheduled_enqueue_time_utc": m.scheduled_enqueue_time_utc, "locked_until_utc": None, "lock_token": None,
            "delivery_count": 0, "message_id": mid, "session_id": m.session_id, "partition_key": m.partition_key,
            "correlation_id": m.correlation_id, "subject": m.subject, "to": m.to, "reply_to": m.reply_to,
            "reply_to_session_id": m.reply_to_session_id, "content_type": m.content_type,
            "time_to_live_ms": int(ttl.total_seconds() * 1000) if ttl is not None else None,
            "size_in_bytes": size, "transfer_hop_count": 0, "dead_letter_reason": None,
            "dead_letter_error_description": None, "dead_letter_source": None,
            "application_properties": json.dumps(m.application_properties) if m.application_properties else None,
            "body": m.body,
        }
        for k, v in row.items():
            cols[k].append(v)
    return pa.table(cols, schema=_ROW_SCHEMA), keys


class MessageBatch:
    """Messages that fit one send (SDK: ServiceBusMessageBatch); add_message raises when one would not fit."""

    def __init__(self, max_size_in_bytes: int) -> None:
        self.max_size_in_bytes = max_size_in_bytes
        self._messages: list[Message] = []
        self._size = 0

    def add_message(self, message: Message) -> None:
        """Add a message, or raise MessageSizeExceededError (a ValueError) if the batch would overflow."""
        if not isinstance(message, Message):
            raise InvalidOperationError(f"expected Message, got {type(message).__name__}")
        size = message.size_in_bytes
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
