"""What the CLI does beyond single library calls, built on the public API: lookup, file input, purge, resubmit."""

import base64
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace, ReceivedMessage, ReceiveMode, SubQueue
from sparkqueue.errors import (
    EntityNotFoundError,
    InvalidOperationError,
    MessageLockLostError,
    MessageSizeExceededError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
)
from sparkqueue.message import as_message
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.model.properties import RuntimeProperties
from sparkqueue.receiver import Receiver
from sparkqueue.sender import Sender
from sparkqueue.storage.schema import STRING_PROPERTY_COLUMNS

log = logging.getLogger(__name__)

ANY_SESSION = "*"  # --session value meaning NEXT_AVAILABLE_SESSION
MAX_TX_MESSAGES = 50  # a transaction holds at most 100 operations: 50 sends plus their 50 completions

Progress = Callable[[int], None]


def _no_progress(_: int) -> None:
    """Progress callback that ignores updates."""


# ---- entity lookup -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """An entity named on the command line: a queue, a topic, or a topic's subscription."""

    kind: str
    name: str
    subscription: str | None = None

    @property
    def display(self) -> str:
        """The name as the user writes it (TOPIC/SUBSCRIPTION for subscriptions)."""
        return f"{self.name}/{self.subscription}" if self.subscription else self.name

    @property
    def label(self) -> str:
        """Kind and name, for messages."""
        return f"{self.kind} {self.display!r}"


def resolve(ns: Namespace, name: str) -> Target:
    """What NAME refers to: TOPIC/Subscriptions/SUBSCRIPTION, else a queue, else a topic, else TOPIC/SUBSCRIPTION.

    The short TOPIC/SUBSCRIPTION form splits at the last '/'; a queue named like it (queue names
    may hold '/') comes first, and the Service Bus path form always names the subscription.
    """
    topic, sub = Address.split_path(name)
    if sub is not None:
        ns.get_subscription(topic, sub)  # EntityNotFoundError names what is missing
        return Target(SUBSCRIPTION, topic, sub)
    limits.check_entity_name(name, "entity")
    try:
        ns.get_queue(name)
        return Target(QUEUE, name)
    except EntityNotFoundError:
        pass
    try:
        ns.get_topic(name)
        return Target(TOPIC, name)
    except EntityNotFoundError:
        pass
    if (short := Address.split_short(name)) is not None:
        try:
            ns.get_subscription(*short)
            return Target(SUBSCRIPTION, *short)
        except EntityNotFoundError:
            pass
    raise EntityNotFoundError(f"no queue, topic or subscription named {name!r} in namespace {ns.root!r}")


def settings(ns: Namespace, target: Target) -> Any:
    """The entity's settings object (QueueProperties, TopicProperties or SubscriptionProperties)."""
    if target.kind == QUEUE:
        return ns.get_queue(target.name)
    if target.kind == TOPIC:
        return ns.get_topic(target.name)
    assert target.subscription is not None
    return ns.get_subscription(target.name, target.subscription)


def runtime(ns: Namespace, target: Target) -> RuntimeProperties:
    """Runtime properties with the per-partition breakdown."""
    if target.kind == QUEUE:
        return ns.get_queue_runtime_properties(target.name)
    if target.kind == TOPIC:
        return ns.get_topic_runtime_properties(target.name)
    assert target.subscription is not None
    return ns.get_subscription_runtime_properties(target.name, target.subscription)


def _topic_is_not_readable(ns: Namespace, target: Target) -> InvalidOperationError:
    subs = ", ".join(f"{target.name}/{s.name}" for s in ns.list_subscriptions(target.name)) or "none yet"
    return InvalidOperationError(
        f"{target.name!r} is a topic: messages are read from its subscriptions, named TOPIC/SUBSCRIPTION ({subs})"
    )


def receiver(
    ns: Namespace,
    target: Target,
    *,
    dead_letter: bool = False,
    mode: ReceiveMode = ReceiveMode.PEEK_LOCK,
    session: str | None = None,
    wait: float | None = None,
) -> Receiver:
    """A receiver of a queue or subscription (or its dead-letter sub-queue, or one session).

    `wait`: seconds to wait for a session with messages ('*'); OperationTimeoutError when none comes.
    """
    if target.kind == TOPIC:
        raise _topic_is_not_readable(ns, target)
    session_id: Any = NEXT_AVAILABLE_SESSION if session == ANY_SESSION else session
    kwargs: dict[str, Any] = {
        "receive_mode": mode,
        "sub_queue": SubQueue.DEAD_LETTER if dead_letter else None,
        "session_id": session_id,
        "max_wait_time": wait or None,
    }
    if session is None and not dead_letter and getattr(settings(ns, target), "requires_session", False):
        raise InvalidOperationError(
            f"{target.label} requires sessions: pass --session SESSION_ID (or '{ANY_SESSION}' for the next available one)"
        )
    if target.kind == QUEUE:
        return ns.get_queue_receiver(target.name, **kwargs)
    assert target.subscription is not None
    return ns.get_subscription_receiver(target.name, target.subscription, **kwargs)


def sender(ns: Namespace, target: Target) -> Sender:
    """A sender to a queue or topic."""
    if target.kind == QUEUE:
        return ns.get_queue_sender(target.name)
    if target.kind == TOPIC:
        return ns.get_topic_sender(target.name)
    raise InvalidOperationError(f"{target.label} cannot be sent to directly: send to its topic {target.name!r}")


# ---- reading messages ------------------------------------------------------------------------------


def peek(
    ns: Namespace,
    target: Target,
    count: int,
    *,
    dead_letter: bool = False,
    from_sequence: int | None = None,
    session: str | None = None,
) -> list[ReceivedMessage]:
    """Browse up to `count` messages without locking them (peek may return fewer per call, so loop)."""
    out: list[ReceivedMessage] = []
    with _session_receiver(ns, target, dead_letter=dead_letter, session=session, wait=0) as r:
        if r is None:
            return out
        start = from_sequence
        while len(out) < count:
            got = r.peek_messages(count - len(out), sequence_number=start)
            start = None
            if not got:
                break
            out.extend(got)
    return out


def receive(
    ns: Namespace,
    target: Target,
    count: int,
    *,
    wait: float,
    dead_letter: bool = False,
    session: str | None = None,
    handle: Callable[[Receiver, list[ReceivedMessage]], None],
) -> list[ReceivedMessage]:
    """Receive up to `count` messages (waiting up to `wait` s for the first), then pass them to `handle` to settle."""
    out: list[ReceivedMessage] = []
    with _session_receiver(ns, target, dead_letter=dead_letter, session=session, wait=wait) as r:
        if r is None:
            return out
        while len(out) < count:
            got = r.receive_messages(max_message_count=count - len(out), max_wait_time=None if out or wait <= 0 else wait)
            if not got:
                break
            out.extend(got)
        if out:
            handle(r, out)
    return out


@contextlib.contextmanager
def _session_receiver(
    ns: Namespace, target: Target, *, dead_letter: bool, session: str | None, wait: float
) -> Iterator[Receiver | None]:
    """The receiver, or None when no session ('*') with available messages could be locked within `wait` s.

    An empty queue then reads like one without sessions: no messages, not an error.
    """
    try:
        r = receiver(ns, target, dead_letter=dead_letter, session=session, wait=wait)
    except OperationTimeoutError:
        if session != ANY_SESSION:
            raise
        yield None
        return
    r.max_wait_time = 0.0  # the wait was for a session; each receive below says how long it waits
    with r:
        yield r


# ---- sending from a file ---------------------------------------------------------------------------

JSONL_FIELDS = frozenset(
    {
        "body",
        "body_base64",
        "application_properties",
        "properties",
        "time_to_live",
        "scheduled_enqueue_time_utc",
        *STRING_PROPERTY_COLUMNS,
    }
)


# What `peek --json` and `receive --json` add (render.message_dict): the broker assigns them, so a record that
# carries them is sent again as a new message, and they are read and dropped.
BROKER_FIELDS = frozenset(
    {
        "sequence_number",
        "partition_id",
        "state",
        "delivery_count",
        "enqueued_time_utc",
        "expires_at_utc",
        "locked_until_utc",
        "dead_letter_reason",
        "dead_letter_error_description",
        "dead_letter_source",
        "size_in_bytes",
    }
)


def message_from_json(obj: object) -> Message:
    """A Message from one JSON-lines record: `body` (or `body_base64`) and optional message properties."""
    if not isinstance(obj, dict):
        raise InvalidOperationError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - JSONL_FIELDS - BROKER_FIELDS)
    if unknown:
        raise InvalidOperationError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(JSONL_FIELDS))}")
    if ("body" in obj) == ("body_base64" in obj):
        raise InvalidOperationError("give exactly one of 'body' and 'body_base64'")
    if "application_properties" in obj and "properties" in obj:
        raise InvalidOperationError("give 'application_properties' or its alias 'properties', not both")
    kwargs: dict[str, Any] = {k: obj[k] for k in STRING_PROPERTY_COLUMNS if obj.get(k) is not None}
    if "body_base64" in obj:
        try:
            body: bytes | str = base64.b64decode(obj["body_base64"], validate=True)
        except (ValueError, TypeError) as e:
            raise InvalidOperationError(f"body_base64 is not valid base64: {e}") from None
    elif isinstance(obj["body"], str):
        body = obj["body"]
    elif obj["body"] is None:
        raise InvalidOperationError("body is null")
    else:  # a JSON value: stored as its JSON text
        body = json.dumps(obj["body"], separators=(",", ":"))
        kwargs.setdefault("content_type", "application/json")
    props = obj.get("application_properties", obj.get("properties"))
    if props is not None:
        kwargs["application_properties"] = props
    ttl = obj.get("time_to_live")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
            raise InvalidOperationError(f"time_to_live must be a number of seconds, got {ttl!r}")
        if abs(ttl) >= timedelta.max.total_seconds():
            raise InvalidOperationError(f"time_to_live {ttl!r} seconds is not a duration sparkqueue can store")
        kwargs["time_to_live"] = timedelta(seconds=ttl)
    when = obj.get("scheduled_enqueue_time_utc")
    if when is not None:
        try:
            at = datetime.fromisoformat(when) if isinstance(when, str) else None
        except ValueError:
            at = None
        if at is None:
            raise InvalidOperationError(f"scheduled_enqueue_time_utc must be an ISO-8601 time, got {when!r}")
        kwargs["scheduled_enqueue_time_utc"] = at if at.tzinfo else at.replace(tzinfo=UTC)
    return Message(body, **kwargs)


def _no_constant(name: str) -> None:
    """json.loads hook: NaN and Infinity are not JSON, and strict readers of stored properties reject them."""
    raise InvalidOperationError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """json.loads hook: a number too large for a float (1e999) would become Infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise InvalidOperationError(f"{text} is out of range for a number")
    return value


def parse_json(line: bytes) -> object:
    """One JSON-lines record; an error for NaN/Infinity, out-of-range numbers and nesting too deep to process."""
    try:
        return json.loads(line, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidOperationError("the JSON is nested too deeply") from None


def iter_messages(stream: IO[bytes], source: str, *, jsonl: bool) -> Iterator[tuple[int, Message]]:
    """(line number, message) pairs: one message per non-empty line (its bytes), or per JSON-lines record."""
    for lineno, raw in enumerate(stream, 1):
        line = raw.rstrip(b"\r\n")
        if not (line.strip() if jsonl else line):
            continue
        try:
            yield lineno, message_from_json(parse_json(line)) if jsonl else Message(line)
        except (InvalidOperationError, MessageSizeExceededError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidOperationError(f"{source}, line {lineno}: {e}") from None
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # a value the message cannot hold
            raise InvalidOperationError(f"{source}, line {lineno}: {type(e).__name__}: {e}") from None


def check_size(s: Sender, m: Message, source: str, lineno: int) -> None:
    """Raise MessageSizeExceededError, naming the line, for a message too large to send."""
    batch = s.create_message_batch()
    try:
        batch.add_message(m)
    except MessageSizeExceededError:
        raise MessageSizeExceededError(
            f"{source}, line {lineno}: the message is {m.size_in_bytes} bytes; at most {batch.max_size_in_bytes} are allowed"
        ) from None


@dataclass
class SendResult:
    """What a send from a file did."""

    read: int = 0
    stored: int = 0  # rows stored: messages on a queue, subscription copies on a topic


def count_messages(path: Path, *, jsonl: bool, check: Sender) -> int:
    """Validate every message of the file (format and size) without sending anything; returns their number."""
    n = 0
    with path.open("rb") as f:
        for lineno, m in iter_messages(f, str(path), jsonl=jsonl):
            check_size(check, m, str(path), lineno)
            n += 1
    return n


def send_stream(
    s: Sender,
    stream: IO[bytes],
    source: str,
    *,
    jsonl: bool,
    batch: int,
    progress: Progress = _no_progress,
    result: SendResult | None = None,
) -> SendResult:
    """Send a file's messages in batches of `batch` (each batch is one atomic send), counted in `result` as they go.

    A failure midway leaves the batches before it sent: the caller's `result` says how many.
    """
    result = result if result is not None else SendResult()
    pending: list[Message] = []

    def flush() -> None:
        result.stored += len(s.send_messages(pending))
        result.read += len(pending)
        progress(len(pending))
        pending.clear()

    for lineno, m in iter_messages(stream, source, jsonl=jsonl):
        check_size(s, m, source, lineno)
        pending.append(m)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    return result


# ---- purge -----------------------------------------------------------------------------------------


def purge(ns: Namespace, target: Target, *, dead_letter: bool, batch: int = 500, progress: Progress = _no_progress) -> int:
    """Delete every available message (RECEIVE_AND_DELETE in batches); locked, deferred and scheduled ones stay."""
    if target.kind == TOPIC:
        raise _topic_is_not_readable(ns, target)
    sessions = not dead_letter and bool(getattr(settings(ns, target), "requires_session", False))
    if not sessions:
        with receiver(ns, target, dead_letter=dead_letter, mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
            return _drain(r, batch, progress)
    total = 0
    while True:  # one session at a time, until no session has available messages
        try:
            r = receiver(ns, target, mode=ReceiveMode.RECEIVE_AND_DELETE, session=ANY_SESSION)
        except (SessionCannotBeLockedError, OperationTimeoutError):  # no session with available messages is free
            return total
        with r:
            got = _drain(r, batch, progress)
        if got == 0:
            return total
        total += got


def _drain(r: Receiver, batch: int, progress: Progress) -> int:
    n = 0
    while True:
        got = r.receive_messages(max_message_count=batch, max_wait_time=None)
        if not got:
            return n
        n += len(got)
        progress(len(got))


# ---- resubmit --------------------------------------------------------------------------------------


@dataclass
class ResubmitResult:
    """What a resubmit did."""

    destination: Target
    transactional: int = 0  # sent and completed in one transaction (exactly once)
    at_least_once: int = 0  # sent, then completed (a crash in between leaves a duplicate)
    not_accepted: int = 0  # dropped by duplicate detection (or matched no subscription): left in the dead-letter queue
    returned: int = 0  # dead-lettered again while this ran (a forward that cannot travel): left there, not resent

    @property
    def resubmitted(self) -> int:
        """Dead letters moved back."""
        return self.transactional + self.at_least_once


def resubmit(
    ns: Namespace,
    target: Target,
    *,
    via_topic: bool = False,
    limit: int | None = None,
    batch: int = 100,
    progress: Progress = _no_progress,
) -> ResubmitResult:
    """Move dead letters back to their entity: receive them peek-locked, send a copy, complete the dead letter.

    On a queue, messages with a partition key (or session) are sent and completed in one transaction
    per key, so each moves exactly once. Unkeyed messages, and subscription dead letters (which go to
    the topic: a transaction acts on one entity), are sent and then completed: at least once, so a
    crash between the two leaves the copy and the dead letter. On a duplicate-detecting entity each
    copy is sent alone; one dropped as a duplicate (its id is still in the detection window) stays
    in the dead-letter queue and is counted as not accepted. Only dead letters enqueued before the
    resubmit began are moved: a copy that comes straight back (its entity forwards to a destination
    deleted or disabled since) is left there and counted as returned, so the run ends.
    """
    if target.kind == TOPIC:
        raise _topic_is_not_readable(ns, target)
    if target.kind == QUEUE and via_topic:
        raise InvalidOperationError(f"{target.label} is a queue: --via-topic applies to a subscription's dead letters")
    destination = target if target.kind == QUEUE else Target(TOPIC, target.name)
    if target.kind == SUBSCRIPTION and not via_topic:
        raise InvalidOperationError(
            f"dead letters of {target.label} go back through topic {target.name!r}, which copies them to every "
            "subscription whose rules match; pass --via-topic to do that"
        )
    dedupe = bool(getattr(settings(ns, destination), "requires_duplicate_detection", False))
    result = ResubmitResult(destination)
    held: dict[int, ReceivedMessage] = {}  # not accepted or returned: kept locked (so not received again) until the end
    started = datetime.now(UTC)
    with receiver(ns, target, dead_letter=True) as r, sender(ns, destination) as s:
        while limit is None or result.resubmitted < limit:
            want = batch if limit is None else min(batch, limit - result.resubmitted)
            got = r.receive_messages(max_message_count=want, max_wait_time=None)
            if not got:
                break
            fresh = []
            for m in got:
                if m.sequence_number in held:
                    held[m.sequence_number] = m  # its lock lapsed and we received it again
                elif m.enqueued_time_utc is not None and m.enqueued_time_utc >= started:
                    held[m.sequence_number] = m  # enqueued since this began: a copy of ours that came back
                    result.returned += 1
                else:
                    fresh.append(m)
            if dedupe:
                _one_by_one(r, s, fresh, held, result, progress)
            elif destination.kind == QUEUE:
                _by_key(ns, r, s, fresh, result, progress)
            else:
                _at_least_once(r, s, fresh, result, progress)
        if held:
            with contextlib.suppress(MessageLockLostError):  # a lapsed lock: available again anyway
                r.abandon_messages(list(held.values()))
    return result


def _one_by_one(
    r: Receiver,
    s: Sender,
    msgs: list[ReceivedMessage],
    held: dict[int, ReceivedMessage],
    result: ResubmitResult,
    progress: Progress,
) -> None:
    for m in msgs:
        if s.send_messages(as_message(m)):
            r.complete_message(m)
            result.at_least_once += 1
        else:
            held[m.sequence_number] = m
            result.not_accepted += 1
        progress(1)


def _at_least_once(r: Receiver, s: Sender, msgs: list[ReceivedMessage], result: ResubmitResult, progress: Progress) -> None:
    if not msgs:
        return
    s.send_messages([as_message(m) for m in msgs])
    r.complete_messages(msgs)
    result.at_least_once += len(msgs)
    progress(len(msgs))


def _by_key(
    ns: Namespace, r: Receiver, s: Sender, msgs: list[ReceivedMessage], result: ResubmitResult, progress: Progress
) -> None:
    """Keyed messages: one transaction per key (and chunk); unkeyed ones at least once."""
    groups: dict[tuple[str | None, str], list[ReceivedMessage]] = {}
    unkeyed: list[ReceivedMessage] = []
    for m in msgs:
        key = m.session_id or m.partition_key
        if key is None:
            unkeyed.append(m)
        else:
            groups.setdefault((m.session_id, key), []).append(m)
    for group in groups.values():
        for i in range(0, len(group), MAX_TX_MESSAGES):
            chunk = group[i : i + MAX_TX_MESSAGES]
            try:
                with ns.transaction():
                    s.send_messages([as_message(m) for m in chunk])
                    r.complete_messages(chunk)
            except InvalidOperationError as e:  # e.g. the dead letter sits outside its key's partition
                log.info("resubmitting %d message(s) outside a transaction: %s", len(chunk), e)
                unkeyed.extend(chunk)
                continue
            result.transactional += len(chunk)
            progress(len(chunk))
    _at_least_once(r, s, unkeyed, result, progress)
