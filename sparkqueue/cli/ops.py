"""What the CLI does beyond single library calls, built on the public API: lookup, file input, purge, resubmit."""

import base64
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import IO, Any, TypeVar

from sparkqueue import NEXT_AVAILABLE_SESSION, AutoLockRenewer, Message, Namespace, ReceivedMessage, ReceiveMode, SubQueue
from sparkqueue.errors import (
    EntityNotFoundError,
    InvalidOperationError,
    MessageLockLostError,
    MessageSizeExceededError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
    SparkQueueError,
)
from sparkqueue.message import MessageBatch, SendSettings, as_message, is_settled, send_settings, to_rows
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.model.properties import RuntimeProperties
from sparkqueue.receiver import Receiver
from sparkqueue.sender import Sender
from sparkqueue.storage.schema import STRING_PROPERTY_COLUMNS

log = logging.getLogger(__name__)

ANY_SESSION = "*"  # --session value meaning NEXT_AVAILABLE_SESSION
MAX_TX_MESSAGES = limits.MAX_TRANSACTION_MESSAGES // 2  # a transaction's operations: each send plus its completion
RESUBMIT_RENEWAL_S = 24 * 3600.0  # how long a resubmit keeps renewing the locks of the dead letters it holds
T = TypeVar("T")

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
    sessions = bool(getattr(settings(ns, target), "requires_session", False))
    if session is None and not dead_letter and sessions:
        raise InvalidOperationError(
            f"{target.label} requires sessions: pass --session SESSION_ID (or '{ANY_SESSION}' for the next available one)"
        )
    if session is not None and not dead_letter and not sessions:  # the library's words name its keyword, not the option
        raise InvalidOperationError(f"{target.label} is not session-enabled: leave out --session (sessions are set at creation)")
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
    """Browse up to `count` messages without locking them (peek may return fewer per call, so loop).

    A session entity is browsed through a session receiver, as in the SDK: that locks the session while it
    browses, and a session another receiver holds cannot be browsed (SessionCannotBeLockedError).
    """
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


def send_rules(ns: Namespace, target: Target) -> SendSettings:
    """The entity settings each message of a send must satisfy (sessions, duplicate detection, the tier's size)."""
    return send_settings(ns.tier, settings(ns, target))


def check_messages(rules: SendSettings, numbered: list[tuple[int, Message]], source: str) -> None:
    """Apply the per-message checks of a send (the library's own, without storage access); the error names the line.

    One check for the whole list; only when it fails is each message checked alone, to find the line.
    """
    try:
        to_rows([m for _, m in numbered], rules, datetime.now(UTC))
    except (SparkQueueError, ValueError, TypeError, OverflowError):
        for lineno, m in numbered:
            try:
                to_rows([m], rules, datetime.now(UTC))
            except (SparkQueueError, ValueError, TypeError, OverflowError) as e:
                raise InvalidOperationError(f"{source}, line {lineno}: {e}") from None
        raise


def checked(
    numbered: Iterable[tuple[int, Message]], rules: SendSettings, source: str, chunk: int = 500
) -> Iterator[tuple[int, Message]]:
    """The (line number, message) pairs, each `chunk` of them checked (check_messages) before any is passed on."""
    it = iter(numbered)
    while part := list(islice(it, chunk)):
        check_messages(rules, part, source)
        yield from part


def batches(
    s: Sender, items: Iterable[T], most: int, message: Callable[[T], Any] = as_message
) -> Iterator[tuple[MessageBatch, list[T]]]:
    """The items' messages in the SDK's batches (create_message_batch, add_message), each full or holding `most`.

    A message too large for an empty batch raises MessageSizeExceededError.
    """
    batch = s.create_message_batch()
    taken: list[T] = []
    for item in items:
        m = message(item)
        try:
            batch.add_message(m)
        except MessageSizeExceededError:
            if not taken:
                raise
            yield batch, taken
            batch, taken = s.create_message_batch(), []
            batch.add_message(m)
        taken.append(item)
        if len(taken) >= most:
            yield batch, taken
            batch, taken = s.create_message_batch(), []
    if taken:
        yield batch, taken


@dataclass
class SendResult:
    """What a send from a file did."""

    read: int = 0
    stored: int = 0  # rows stored: messages on a queue, subscription copies on a topic


def count_messages(path: Path, *, jsonl: bool, rules: SendSettings) -> int:
    """Validate every message of the file (format, size, the entity's rules) without sending anything; returns their number."""
    with path.open("rb") as f:
        return sum(1 for _ in checked(iter_messages(f, str(path), jsonl=jsonl), rules, str(path)))


def send_stream(
    s: Sender,
    stream: IO[bytes],
    source: str,
    *,
    jsonl: bool,
    batch: int,
    rules: SendSettings | None,
    progress: Progress = _no_progress,
    result: SendResult | None = None,
) -> SendResult:
    """Send a stream's messages in batches (each one atomic send, full or of `batch` messages), counted in `result`.

    Each batch is checked first (`checked`, naming the line of a bad message); `rules` None: the caller checked every
    message already (count_messages). A failure midway leaves the batches before it sent: `result` says how many.
    """
    result = result if result is not None else SendResult()
    numbered = iter_messages(stream, source, jsonl=jsonl)
    if rules is not None:
        numbered = checked(numbered, rules, source, batch)
    for full, taken in batches(s, numbered, batch, lambda item: item[1]):
        result.stored += len(s.send_messages(full))
        result.read += len(taken)
        progress(len(taken))
    return result


# ---- purge -----------------------------------------------------------------------------------------


@dataclass
class PurgeResult:
    """What a purge did (counted as it goes, so a failure midway still says how many were deleted)."""

    purged: int = 0


def purge(
    ns: Namespace,
    target: Target,
    *,
    dead_letter: bool,
    batch: int = 500,
    progress: Progress = _no_progress,
    result: PurgeResult | None = None,
) -> PurgeResult:
    """Delete every available message (RECEIVE_AND_DELETE in batches); locked, deferred and scheduled ones stay."""
    result = result if result is not None else PurgeResult()
    if target.kind == TOPIC:
        raise _topic_is_not_readable(ns, target)
    sessions = not dead_letter and bool(getattr(settings(ns, target), "requires_session", False))
    if not sessions:
        with receiver(ns, target, dead_letter=dead_letter, mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
            _drain(r, batch, progress, result)
        return result
    while True:  # one session at a time, until no session has available messages
        try:
            r = receiver(ns, target, mode=ReceiveMode.RECEIVE_AND_DELETE, session=ANY_SESSION)
        except (SessionCannotBeLockedError, OperationTimeoutError):  # no session with available messages is free
            return result
        before = result.purged
        with r:
            _drain(r, batch, progress, result)
        if result.purged == before:
            return result


def _drain(r: Receiver, batch: int, progress: Progress, result: PurgeResult) -> None:
    """Receive (and so delete) until nothing comes, counting in `result`."""
    while got := r.receive_messages(max_message_count=batch, max_wait_time=None):
        result.purged += len(got)
        progress(len(got))


# ---- resubmit --------------------------------------------------------------------------------------


@dataclass
class ResubmitResult:
    """What a resubmit did (counted as it goes, so a failure midway still says what was moved)."""

    destination: Target
    transactional: int = 0  # sent and completed in one transaction (exactly once)
    at_least_once: int = 0  # sent, then completed (a crash in between leaves a duplicate)
    not_accepted: int = 0  # dropped by duplicate detection, or (a topic) matched no subscription: left in the DLQ
    returned: int = 0  # dead-lettered again while this ran (a forward that cannot travel): left there, not resent
    dedupe: bool = False  # the destination detects duplicates

    @property
    def resubmitted(self) -> int:
        """Dead letters moved back."""
        return self.transactional + self.at_least_once

    @property
    def touched(self) -> bool:
        """Whether the run did anything: moved, or left in place, at least one dead letter."""
        return bool(self.resubmitted or self.not_accepted or self.returned)


def resubmit_destination(ns: Namespace, target: Target, *, via_topic: bool) -> Target:
    """Where the dead letters of `target` go back to: the queue itself, or (--via-topic) a subscription's topic."""
    if target.kind == TOPIC:
        raise _topic_is_not_readable(ns, target)
    if target.kind == QUEUE and via_topic:
        raise InvalidOperationError(f"{target.label} is a queue: --via-topic applies to a subscription's dead letters")
    if target.kind == SUBSCRIPTION and not via_topic:
        raise InvalidOperationError(
            f"dead letters of {target.label} go back through topic {target.name!r}, which copies them to every "
            "subscription whose rules match; pass --via-topic to do that"
        )
    return target if target.kind == QUEUE else Target(TOPIC, target.name)


def resubmit(
    ns: Namespace,
    target: Target,
    result: ResubmitResult,
    *,
    limit: int | None = None,
    batch: int = 100,
    progress: Progress = _no_progress,
) -> ResubmitResult:
    """Move dead letters back to `result.destination`: receive them peek-locked, send a copy, complete the dead letter.

    On a queue, messages with a partition key (or session) are sent and completed in one transaction
    per key, so each moves exactly once. Unkeyed messages are sent and then completed: at least once,
    so a crash between the two leaves the copy and the dead letter. On a duplicate-detecting entity, and
    on a topic (a copy may match no subscription), each copy is sent alone and its dead letter completed
    only when the send stored it; one that stored nothing (a duplicate, or no subscription's rules
    matched) stays in the dead-letter queue and is counted as not accepted. Only dead letters enqueued
    before the resubmit began are moved: a copy that comes straight back (its entity forwards to a
    destination deleted or disabled since) is left there and counted as returned, so the run ends.
    Sends are filled as the SDK's batches. Dead letters held back are abandoned at the end, and on an
    error every dead letter received and not completed is abandoned before it propagates, so the next
    run sees them at once; `result` then says what was done before it.
    """
    destination = result.destination
    result.dedupe = bool(getattr(settings(ns, destination), "requires_duplicate_detection", False))
    held: dict[int, ReceivedMessage] = {}  # not accepted or returned: kept locked (so not received again) until the end
    fresh: list[ReceivedMessage] = []
    started = datetime.now(UTC)
    # Copies sent one by one (a topic, duplicate detection) can outlast a short lock: the renewer keeps every dead
    # letter held until it is completed or abandoned, so none is moved and left in place too.
    renewer = AutoLockRenewer(max_lock_renewal_duration=RESUBMIT_RENEWAL_S)
    with receiver(ns, target, dead_letter=True) as r, sender(ns, destination) as s, renewer:
        try:
            while limit is None or result.resubmitted < limit:
                want = batch if limit is None else min(batch, limit - result.resubmitted)
                got = r.receive_messages(max_message_count=want, max_wait_time=None)
                if not got:
                    break
                for m in got:
                    renewer.register(r, m)
                fresh = []
                for m in got:
                    if m.sequence_number in held:
                        held[m.sequence_number] = m  # its lock lapsed and we received it again
                    elif m.enqueued_time_utc is not None and m.enqueued_time_utc >= started:
                        held[m.sequence_number] = m  # enqueued since this began: a copy of ours that came back
                        result.returned += 1
                    else:
                        fresh.append(m)
                if result.dedupe or destination.kind == TOPIC:
                    _one_by_one(r, s, fresh, held, result, progress)
                else:
                    _by_key(ns, r, s, fresh, result, progress)
        except BaseException:
            renewer.close()
            unsettled = {m.sequence_number: m for m in fresh if not is_settled(m)}
            _release(r, [*unsettled.values(), *(m for seq, m in held.items() if seq not in unsettled)], failing=True)
            raise
        renewer.close()
        _release(r, list(held.values()))
    return result


def _release(r: Receiver, msgs: list[ReceivedMessage], *, failing: bool = False) -> None:
    """Abandon the dead letters this run holds, so they are available at once (one whose lock lapsed is anyway).

    While an error propagates (`failing`), one of the abandon's own is logged, not raised: the first error is the one to report.
    """
    if not msgs:
        return
    try:
        r.abandon_messages(msgs)
    except MessageLockLostError:
        pass
    except Exception as exc:
        if not failing:
            raise
        log.warning("could not abandon %d dead letter(s); they are available again when their locks expire: %s", len(msgs), exc)


def _one_by_one(
    r: Receiver,
    s: Sender,
    msgs: list[ReceivedMessage],
    held: dict[int, ReceivedMessage],
    result: ResubmitResult,
    progress: Progress,
) -> None:
    """Send each copy alone and complete its dead letter only if the send stored something; hold the others."""
    for m in msgs:
        if s.send_messages(as_message(m)):
            r.complete_message(m)
            result.at_least_once += 1
        else:
            held[m.sequence_number] = m
            result.not_accepted += 1
        progress(1)


def _at_least_once(r: Receiver, s: Sender, msgs: list[ReceivedMessage], result: ResubmitResult, progress: Progress) -> None:
    """Send the copies in batches, completing each batch's dead letters after its send."""
    for full, sent in batches(s, msgs, max(1, len(msgs))):
        s.send_messages(full)
        r.complete_messages(sent)
        result.at_least_once += len(sent)
        progress(len(sent))


def _by_key(
    ns: Namespace, r: Receiver, s: Sender, msgs: list[ReceivedMessage], result: ResubmitResult, progress: Progress
) -> None:
    """Keyed messages: one transaction per key and batch (at most MAX_TX_MESSAGES); unkeyed ones at least once."""
    groups: dict[tuple[str | None, str], list[ReceivedMessage]] = {}
    unkeyed: list[ReceivedMessage] = []
    for m in msgs:
        key = m.session_id or m.partition_key
        if key is None:
            unkeyed.append(m)
        else:
            groups.setdefault((m.session_id, key), []).append(m)
    for group in groups.values():
        for full, chunk in batches(s, group, MAX_TX_MESSAGES):
            try:
                with ns.transaction():
                    s.send_messages(full)
                    r.complete_messages(chunk)
            except InvalidOperationError as e:  # e.g. the dead letter sits outside its key's partition
                log.info("resubmitting %d message(s) outside a transaction: %s", len(chunk), e)
                unkeyed.extend(chunk)
                continue
            result.transactional += len(chunk)
            progress(len(chunk))
    _at_least_once(r, s, unkeyed, result, progress)
