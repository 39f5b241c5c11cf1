"""Senders (SDK: ServiceBusSender): send, schedule and cancel messages on a queue or topic."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from sparkqueue.broker import refuse_in_transaction
from sparkqueue.errors import (
    InvalidArgumentTypeError,
    InvalidOperationError,
    MessageSizeExceededError,
)
from sparkqueue.message import (
    Message,
    MessageBatch,
    ReceivedMessage,
    as_message,
    as_utc,
    message_label,
    send_settings,
    to_rows,
)
from sparkqueue.model import limits
from sparkqueue.model.addresses import TOPIC
from sparkqueue.model.deadlines import call_timeout
from sparkqueue.model.entity import utcnow
from sparkqueue.model.properties import check_status
from sparkqueue.model.topics import first_copies

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from sparkqueue.namespace import Namespace

log = logging.getLogger(__name__)


def as_message_list(messages: object) -> list[Message]:
    """Accept one message, a list of them, or a batch; received messages and dicts of Message fields too (as the SDK)."""
    if isinstance(messages, (Message, ReceivedMessage, Mapping)):
        return [as_message(messages)]
    if isinstance(messages, (MessageBatch, list, tuple)):
        return [as_message(m) for m in messages]
    raise InvalidArgumentTypeError(f"expected a Message, a list of Message or a MessageBatch, got {type(messages).__name__}")


def check_fits_one_batch(msgs: list[Message], tier: str) -> None:
    """A list sent in one call must fit one batch (the tier's message size limit), as the SDK requires."""
    cap = limits.MAX_MESSAGE_BYTES[tier]
    sizes = [m.size_in_bytes for m in msgs]  # each computed once: it encodes every string property
    for m, size in zip(msgs, sizes, strict=True):
        if size > cap:
            raise MessageSizeExceededError(f"{message_label(m.message_id)} is {size} bytes; the {tier} tier allows {cap}")
    total = sum(sizes)
    if total > cap:
        raise MessageSizeExceededError(
            f"the {len(msgs)} messages total {total} bytes, more than one batch holds in the {tier} tier ({cap}); "
            "send them in several calls or batches (create_message_batch)"
        )


class Sender:
    """Sends to one queue or topic; a context manager, as in the SDK."""

    def __init__(self, namespace: Namespace, entity_type: str, name: str) -> None:
        self._ns = namespace
        self.entity_type = entity_type
        self.entity_name = limits.check_name_type(name, entity_type)
        self._closed = False
        namespace.broker.entity(entity_type, name)  # fail fast on an unknown entity

    def __enter__(self) -> Sender:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sender: later calls raise ValueError, as in the SDK (create a new sender instead)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidOperationError("the sender is closed; get a new one from the namespace")

    def create_message_batch(self, max_size_in_bytes: int | None = None) -> MessageBatch:
        """An empty batch bounded by the tier's message size limit, or by `max_size_in_bytes`.

        sparkqueue sends a batch as one Delta commit, so a batch may be larger than the SDK
        allows (up to MAX_BATCH_BYTES, for bulk sends such as 1,000 x 1 KB); each message in it
        still respects the tier's message size limit.
        """
        self._check_open()
        cap = limits.MAX_MESSAGE_BYTES[self._ns.tier]
        if max_size_in_bytes is not None:
            limits.check_int(max_size_in_bytes, "max_size_in_bytes")
            if not 0 < max_size_in_bytes <= limits.MAX_BATCH_BYTES:
                raise InvalidOperationError(f"max_size_in_bytes must be between 1 and {limits.MAX_BATCH_BYTES}")
        return MessageBatch(max_size_in_bytes or cap, cap)

    def send_messages(self, message: object, *, timeout: float | None = None) -> list[int]:
        """Send atomically; returns the stored sequence numbers (duplicates dropped by detection have none).

        Accepts a Message, a received message, a dict of Message fields, a list of those, or a
        MessageBatch. A list must fit one batch (MessageSizeExceededError otherwise), as in the SDK.
        """
        self._check_open()
        msgs = as_message_list(message)
        if not isinstance(message, MessageBatch):
            check_fits_one_batch(msgs, self._ns.tier)
        with call_timeout(timeout):
            return self._send(msgs)

    def schedule_messages(self, messages: object, schedule_time_utc: datetime, *, timeout: float | None = None) -> list[int]:
        """Send messages that stay invisible until schedule_time_utc; returns their sequence numbers.

        One number per stored message, also on a topic: its first copy's, which cancel_scheduled_messages
        takes to remove every subscription's copy (docs/semantics.md §5).
        """
        self._check_open()
        if schedule_time_utc is None:
            raise InvalidArgumentTypeError("schedule_time_utc must be a datetime, got None")
        when = as_utc(schedule_time_utc, "schedule_time_utc")
        msgs = as_message_list(messages)
        if not isinstance(messages, MessageBatch):
            check_fits_one_batch(msgs, self._ns.tier)
        for m in msgs:
            m.scheduled_enqueue_time_utc = when
        with call_timeout(timeout):
            return self._send(msgs, one_per_message=True)

    def cancel_scheduled_messages(self, sequence_numbers: int | Sequence[int], *, timeout: float | None = None) -> None:
        """Remove scheduled messages that have not become visible yet."""
        self._check_open()
        seqs = limits.check_sequence_numbers(sequence_numbers)
        # It would apply at once and survive a rollback.
        refuse_in_transaction(self._ns.broker, "scheduled messages cannot be cancelled inside a transaction")
        with call_timeout(timeout):
            self._ns.broker.entity(self.entity_type, self.entity_name).cancel_scheduled(seqs)

    def send_dataframe(self, df: DataFrame, spark: SparkSession | None = None, *, preserve_order: bool | None = None) -> int:
        """Send each row of a DataFrame as a message, in Spark tasks per partition; returns how many were accepted.

        Columns are named as Message fields (docs/semantics.md §12); `spark` is accepted for symmetry (the
        DataFrame's own session runs the job). `preserve_order` (default: when rows may carry a
        session id or partition key) keeps the DataFrame's row order within each queue partition.
        See sparkqueue.spark.send.
        """
        from sparkqueue.spark.send import send_dataframe

        self._check_open()
        return send_dataframe(self._ns.broker, self.entity_type, self.entity_name, df, preserve_order=preserve_order)

    def _send(self, msgs: list[Message], *, one_per_message: bool = False) -> list[int]:
        """Store the messages through the broker's one send path (inside a transaction: recorded, no numbers yet).

        Returns the stored rows' numbers: on a topic every copy's, or with `one_per_message` each message's first copy's.
        """
        if not msgs:
            return []
        entity = self._ns.broker.entity(self.entity_type, self.entity_name)
        check_status(entity.props, "send", entity.name)
        rows, keys = to_rows(msgs, send_settings(self._ns.tier, entity.props), utcnow())
        stored = self._ns.broker.send(self.entity_type, self.entity_name, rows, keys)
        if self.entity_type == TOPIC:
            if not one_per_message:
                seqs: list[int] = stored.column("sequence_number").to_pylist()
                return seqs  # every copy's number
            stored = first_copies(stored, rows)
        return _in_given_order(rows, stored)


def _in_given_order(sent: pa.Table, stored: pa.Table) -> list[int]:
    """The stored messages' numbers in the order the messages were given (the store returns them partition by partition).

    A message the send dropped (a duplicate within the detection window) has no number. Messages
    are matched on their id and keys (session id, partition key): two sharing an id but not their
    keys may sit in different partitions, returned in partition order. Messages sharing all three
    share a partition and take their numbers in the order they were stored; a topic copy whose
    rule action changed its keys is matched on its id alone.
    """
    seqs: list[int] = stored.column("sequence_number").to_pylist()
    if all(stored.column(c).equals(sent.column(c)) for c in MATCH_COLUMNS):
        return seqs  # one partition, nothing dropped: the common batch needs no mapping (compared in Arrow, not Python)
    sent_keys, stored_keys = _match_keys(sent), _match_keys(stored)
    by_key: dict[tuple[str | None, ...], deque[int]] = {}
    for key, seq in zip(stored_keys, seqs, strict=True):
        by_key.setdefault(key, deque()).append(seq)
    found = [_pop(by_key.get(key)) for key in sent_keys]
    by_id: dict[str | None, deque[int]] = {}  # what no message's keys matched, by id alone
    for key, left in by_key.items():
        by_id.setdefault(key[0], deque()).extend(left)
    out = []
    for key, number in zip(sent_keys, found, strict=True):
        if number is None:
            number = _pop(by_id.get(key[0]))
        if number is not None:
            out.append(number)
    return out


MATCH_COLUMNS = ("message_id", "session_id", "partition_key")  # what places a message in its partition


def _match_keys(rows: pa.Table) -> list[tuple[str | None, ...]]:
    """Per row: its MATCH_COLUMNS values."""
    return list(zip(*(rows.column(c).to_pylist() for c in MATCH_COLUMNS), strict=True))


def _pop(numbers: deque[int] | None) -> int | None:
    """The next number of a deque; None when it is missing or empty."""
    return numbers.popleft() if numbers else None
