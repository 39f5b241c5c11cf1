"""Helpers shared by the core tests, and the functions the multi-process tests run in child processes.

Child functions take plain picklable arguments, open their own `Namespace(root)` and report back
through multiprocessing primitives or files, so they work with the "spawn" start method.
"""

from __future__ import annotations

import os
import random
import threading
import time
from datetime import UTC, datetime
from typing import Any

import mmh3

from sparkqueue import Message, Namespace, ReceivedMessage, ReceiveMode, SqlRuleFilter
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    InvalidOperationError,
    MessageLockLostError,
    QuotaExceededError,
    SessionLockLostError,
    SparkQueueError,
)
from sparkqueue.receiver import Receiver, ReceiverSession

PARTITIONS = 16


# ---- helpers for tests in this process -----------------------------------------------------------


def partition_for(key: str, n: int = PARTITIONS) -> int:
    """The partition the contract (docs/semantics.md §3) assigns to a key."""
    return mmh3.hash(key.encode("utf-8"), 0, signed=False) % n


def key_for_partition(partition: int, prefix: str = "key", n: int = PARTITIONS) -> str:
    """A partition key that the contract places in `partition`."""
    for i in range(100_000):
        key = f"{prefix}-{i}"
        if partition_for(key, n) == partition:
            return key
    raise AssertionError(f"no key found for partition {partition}")


def sleep_past(moment: datetime, margin_s: float = 0.2) -> None:
    """Sleep until the wall clock is `margin_s` past `moment` (a lock expiry, a TTL, a schedule time)."""
    delay = (moment - datetime.now(UTC)).total_seconds() + margin_s
    if delay > 0:
        time.sleep(delay)


def drain(receiver: Receiver, expected: int, timeout_s: float = 10.0, batch: int = 50) -> list[ReceivedMessage]:
    """Receive until `expected` messages arrived or `timeout_s` passed (a bound on the loop, not an assertion)."""
    out: list[ReceivedMessage] = []
    give_up = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < give_up:
        out.extend(receiver.receive_messages(max_message_count=min(batch, expected - len(out)), max_wait_time=0.2))
    return out


def drain_all(receiver: Receiver, batch: int = 50, idle_s: float = 0.3) -> list[ReceivedMessage]:
    """Receive until a receive that waited `idle_s` returns nothing."""
    out: list[ReceivedMessage] = []
    while True:
        got = receiver.receive_messages(max_message_count=batch, max_wait_time=idle_s)
        if not got:
            return out
        out.extend(got)


def peek_all(receiver: Receiver, batch: int = 100) -> list[ReceivedMessage]:
    """Browse every message from the start, looping as the contract asks (peek may return fewer than asked)."""
    out = receiver.peek_messages(batch, sequence_number=0)
    while True:
        got = receiver.peek_messages(batch)
        if not got:
            return out
        out.extend(got)


# ---- child-process functions ---------------------------------------------------------------------


def _receiver(ns: Namespace, entity: str, **kwargs: Any) -> Receiver:
    """A receiver of a queue, or of a subscription named "topic/subscription"."""
    if "/" in entity:
        topic, subscription = entity.split("/", 1)
        return ns.get_subscription_receiver(topic, subscription, **kwargs)
    return ns.get_queue_receiver(entity, **kwargs)


def _wait(barrier: Any) -> None:
    barrier.wait(timeout=60)


def receive_and_complete(
    root: str, queue: str, barrier: Any, done: Any, total: int, results: Any, worker: int, deadline_s: float = 90.0
) -> None:
    """Race other processes: receive and complete until `done` (shared counter) reaches `total`.

    `queue` may name a subscription as "topic/subscription". Reports (worker, delivered
    [(message_id, delivery_count)], completed [message_id], lock_lost count).
    """
    delivered: list[tuple[str, int]] = []
    completed: list[str] = []
    lost = 0
    with Namespace(root) as ns, _receiver(ns, queue) as receiver:
        _wait(barrier)
        give_up = time.monotonic() + deadline_s
        while done.value < total and time.monotonic() < give_up:
            got = receiver.receive_messages(max_message_count=10, max_wait_time=0.2)
            for m in got:
                delivered.append((m.message_id, m.delivery_count))
                try:
                    receiver.complete_message(m)
                except MessageLockLostError:
                    lost += 1
                    continue
                completed.append(m.message_id)
                with done.get_lock():
                    done.value += 1
    results.put((worker, delivered, completed, lost))


def receive_and_delete(root: str, queue: str, barrier: Any, results: Any, worker: int, idle_s: float) -> None:
    """Race other processes in RECEIVE_AND_DELETE mode until nothing arrived for `idle_s`; report (worker, message ids)."""
    receive_until_idle(root, queue, barrier, results, worker, idle_s, delete=True)


def receive_until_idle(root: str, queue: str, barrier: Any, results: Any, worker: int, idle_s: float, delete: bool) -> None:
    """Receive (and complete, unless `delete`: RECEIVE_AND_DELETE) until nothing arrived for `idle_s`.

    Reports (worker, ids taken): the ids removed, or completed (a complete that lost its lock is not counted).
    """
    taken: list[str] = []
    mode = ReceiveMode.RECEIVE_AND_DELETE if delete else ReceiveMode.PEEK_LOCK
    with Namespace(root) as ns, _receiver(ns, queue, receive_mode=mode) as receiver:
        _wait(barrier)
        last_seen = time.monotonic()
        while time.monotonic() - last_seen < idle_s:
            got = receiver.receive_messages(max_message_count=7, max_wait_time=0.2)
            if got:
                last_seen = time.monotonic()
            for m in got:
                if not delete:
                    try:
                        receiver.complete_message(m)
                    except MessageLockLostError:
                        continue
                taken.append(m.message_id)
    results.put((worker, taken))


def transactional_worker(root: str, queue: str, barrier: Any, results: Any, worker: int, done: Any, tasks: int) -> None:
    """Race other processes on one partition: each task message is completed in a transaction that sends its 2 results.

    Result messages are completed outside transactions. Runs until `done` (tasks committed, shared)
    reaches `tasks` and a receive then finds nothing. Reports (worker, tasks committed, results
    completed, transactions that raised).
    """
    committed: list[str] = []
    finished: list[str] = []
    failed = 0
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender, ns.get_queue_receiver(queue) as receiver:
        _wait(barrier)
        give_up = time.monotonic() + 90
        while time.monotonic() < give_up:
            got = receiver.receive_messages(max_message_count=1, max_wait_time=0.3)
            if not got:
                if done.value >= tasks:
                    break
                continue
            (m,) = got
            if m.message_id.startswith("res-"):
                receiver.complete_message(m)
                finished.append(m.message_id)
                continue
            outputs = [Message(f"result {j}", message_id=f"res-{m.message_id}-{j}", partition_key="k") for j in range(2)]
            try:
                with ns.transaction():
                    sender.send_messages(outputs)
                    receiver.complete_message(m)
            except MessageLockLostError:
                failed += 1
                continue
            committed.append(m.message_id)
            with done.get_lock():
                done.value += 1
    results.put((worker, committed, finished, failed))


def settle_abandon_or_lapse(root: str, queue: str, barrier: Any, results: Any, worker: int, seed: int, idle_s: float) -> None:
    """Race other processes with short locks: complete, abandon, or hold a message past its lock and then try to complete it.

    Runs until no message arrived for `idle_s` and none is held. Reports (worker, deliveries), one
    (message_id, delivery_count, locked_until epoch, outcome, settle_start epoch) per delivery;
    outcome is "completed", "abandoned", "lost" (the settle raised MessageLockLostError) or
    "stale_completed" (a complete past the lock's expiry succeeded: a broken rule).
    """
    rng = random.Random(seed)
    deliveries: list[tuple[str, int, float, str, float]] = []
    held: list[ReceivedMessage] = []

    def settle(m: ReceivedMessage, op: str) -> None:
        start = time.time()
        try:
            (receiver.complete_message if op == "complete" else receiver.abandon_message)(m)
            outcome = "completed" if op == "complete" else "abandoned"
        except MessageLockLostError:
            outcome = "lost"
        assert m.locked_until_utc is not None
        deliveries.append((m.message_id, m.delivery_count, m.locked_until_utc.timestamp(), outcome, start))

    with Namespace(root) as ns, ns.get_queue_receiver(queue) as receiver:
        _wait(barrier)
        last_seen = time.monotonic()
        while held or time.monotonic() - last_seen < idle_s:
            for m in [m for m in held if m.locked_until_utc is not None and m.locked_until_utc.timestamp() + 0.2 < time.time()]:
                held.remove(m)
                settle(m, "complete")  # its lock has expired: the complete must be refused
                if deliveries[-1][3] == "completed":
                    deliveries[-1] = (*deliveries[-1][:3], "stale_completed", deliveries[-1][4])
            got = receiver.receive_messages(max_message_count=3, max_wait_time=0.2)
            if got:
                last_seen = time.monotonic()
            for m in got:
                roll = rng.random()
                if roll < 0.3:
                    held.append(m)
                else:
                    settle(m, "complete" if roll < 0.8 else "abandon")
    results.put((worker, deliveries))


def send_sequence(root: str, queue: str, barrier: Any, results: Any, worker: int, count: int, key: str, batch: int) -> None:
    """Send `count` messages with one partition key, `batch` per call; report the sequence numbers in send order."""
    seqs: list[int] = []
    ids: list[str] = []
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        _wait(barrier)
        for start in range(0, count, batch):
            msgs = [
                Message(f"w{worker}-{i}", message_id=f"w{worker}-{i}", partition_key=key)
                for i in range(start, min(count, start + batch))
            ]
            got = sender.send_messages(msgs)
            seqs.extend(got)
            ids.extend(m.message_id for m in msgs if m.message_id is not None)
    results.put((worker, ids, seqs))


def send_timed(root: str, queue: str, barrier: Any, results: Any, worker: int, count: int, key: str, batch: int) -> None:
    """As send_sequence, timing each call: reports (worker, [(start, end, message ids, sequence numbers)]) on one clock."""
    calls: list[tuple[float, float, list[str], list[int]]] = []
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        _wait(barrier)
        for start in range(0, count, batch):
            ids = [f"w{worker}-{i}" for i in range(start, min(count, start + batch))]
            began = time.time()
            seqs = sender.send_messages([Message(i, message_id=i, partition_key=key) for i in ids])
            calls.append((began, time.time(), ids, seqs))
    results.put((worker, calls))


def send_while_recreated(root: str, queue: str, barrier: Any, results: Any, worker: int, seconds: float) -> None:
    """Send one message at a time for `seconds`; reports (worker, [(start time, message id, outcome)]) on one clock.

    The outcome is "ok" for an acknowledged send, else the error's class name.
    """
    calls: list[tuple[float, str, str]] = []
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        _wait(barrier)
        stop = time.time() + seconds
        i = 0
        while time.time() < stop:
            i += 1
            began = time.time()
            try:
                sender.send_messages(Message("x", message_id=f"w{worker}-{i}"))
                calls.append((began, f"w{worker}-{i}", "ok"))
            except SparkQueueError as exc:
                calls.append((began, f"w{worker}-{i}", type(exc).__name__))
            time.sleep(0.003)
    results.put((worker, calls))


def recreate_queue(root: str, queue: str, barrier: Any, results: Any, worker: int, cycles: int, pause_s: float) -> None:
    """Delete and create the queue again `cycles` times; after each, wait and record (created at, checked at, ids it holds)."""
    windows: list[tuple[float, float, list[str]]] = []
    with Namespace(root) as ns:
        _wait(barrier)
        time.sleep(pause_s)
        for _ in range(cycles):
            ns.delete_queue(queue)
            ns.create_queue(queue, enable_partitioning=False)
            created = time.time()
            time.sleep(pause_s)
            checked = time.time()
            with ns.get_queue_receiver(queue) as r:
                windows.append((created, checked, [m.message_id for m in peek_all(r)]))
    results.put((worker, windows))


def send_ids(
    root: str, queue: str, barrier: Any, results: Any, worker: int, ids: list[str], batch: int, topic: bool = False
) -> None:
    """Send messages with the given ids (`batch` per call) to a queue or topic; report how many sequence numbers came back."""
    stored = 0
    with Namespace(root) as ns, ns.get_topic_sender(queue) if topic else ns.get_queue_sender(queue) as sender:
        _wait(barrier)
        for start in range(0, len(ids), batch):
            msgs = [Message(f"from-{worker}", message_id=i) for i in ids[start : start + batch]]
            stored += len(sender.send_messages(msgs))
    results.put((worker, stored))


def create_queue(root: str, queue: str, barrier: Any, results: Any, worker: int, topic: bool = False) -> None:
    """Open the namespace (maybe creating it) and create the queue (or a topic of that name) at once with the others.

    max_delivery_count (a topic: max_size_in_megabytes) marks who created it; reports "created" or "exists".
    """
    _wait(barrier)
    ns = Namespace(root)
    try:
        if topic:
            ns.create_topic(queue, max_size_in_megabytes=1024 * (worker + 1))
        else:
            ns.create_queue(queue, max_delivery_count=worker + 1)
    except EntityAlreadyExistsError:
        results.put((worker, "exists"))
        return
    except QuotaExceededError:
        results.put((worker, "over quota"))
        return
    results.put((worker, "created"))


def create_rule(root: str, name: str, barrier: Any, results: Any, worker: int) -> None:
    """Create rule `name` on subscription t/s at once with the others; reports "created" or "exists"."""
    _wait(barrier)
    with Namespace(root) as ns:
        try:
            ns.create_rule("t", "s", name, filter=SqlRuleFilter(f"n = {worker}"))
        except EntityAlreadyExistsError:
            results.put((worker, "exists"))
            return
    results.put((worker, "created"))


def send_big(root: str, queue: str, barrier: Any, results: Any, worker: int, size: int) -> None:
    """Send one incompressible message of `size` bytes to a premium namespace's queue at once with the others.

    Reports "sent" or "over quota".
    """
    body = os.urandom(size)
    _wait(barrier)
    with Namespace(root, tier="premium") as ns, ns.get_queue_sender(queue) as sender:
        try:
            sender.send_messages(Message(body, message_id=f"racer-{worker}"))
        except QuotaExceededError:
            results.put((worker, "over quota"))
            return
    results.put((worker, "sent"))


def churn_catalog(root: str, role: str, barrier: Any, results: Any, worker: int, seconds: float) -> None:
    """For `seconds`, create and delete a parent while others add children to it; reports how many children landed.

    Roles: "topic" (create/delete topic t), "subscription" (create/delete subscription t/s, the
    topic kept), "sub-maker" (create_subscription t/s), "rule-maker" (create_rule t/s/r). A maker's
    next create lands once the parent's delete took the child with it.
    """
    ns = Namespace(root)
    _wait(barrier)
    landed = 0
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        try:
            if role == "topic":
                ns.create_topic("t")
                ns.delete_topic("t")
            elif role == "subscription":
                ns.create_subscription("t", "s")
                ns.delete_subscription("t", "s")
            elif role == "sub-maker":
                ns.create_subscription("t", "s")
                landed += 1
            else:
                ns.create_rule("t", "s", "r")
                landed += 1
        except (EntityNotFoundError, EntityAlreadyExistsError):
            pass
    results.put((worker, landed))


def _record(path: str, lines: list[str]) -> None:
    """Append lines to a file durably: once written, the parent can rely on them after a SIGKILL."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def send_and_lock_until_killed(root: str, queue: str, sent_path: str, locked_path: str, batch: int) -> None:
    """Loop forever: send a batch spread over partitions, record it, then lock a few messages and record them."""
    n = 0
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender, ns.get_queue_receiver(queue) as receiver:
        while True:
            msgs = [Message(f"b{n}", message_id=f"b{n}-{k}", partition_key=f"b{n}-{k}") for k in range(batch)]
            sender.send_messages(msgs)
            _record(sent_path, [m.message_id for m in msgs if m.message_id is not None])
            got = receiver.receive_messages(max_message_count=2)
            if got:
                _record(locked_path, [m.message_id for m in got])
            n += 1


def send_dying_at_commit(root: str, queue: str, count: int) -> None:
    """Send `count` keyed messages and SIGKILL this process as the send commits: data files written, log entry not."""
    import signal

    from sparkqueue.storage.log import DeltaLog

    def die(*args: object, **kwargs: object) -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("still alive after SIGKILL")

    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        DeltaLog.commit = die  # type: ignore[method-assign]  # the process dies exactly between the two steps
        sender.send_messages([Message(f"x{k}", message_id=f"x{k}", partition_key=f"x{k}") for k in range(count)])


def renewing(session: ReceiverSession, stop: threading.Event) -> threading.Thread:
    """A started thread renewing the session lock until `stop` is set or the lock is refused, as an AutoLockRenewer's."""

    def renew() -> None:
        while not stop.is_set():
            try:
                session.renew_lock()
            except (InvalidOperationError, SessionLockLostError):
                return

    thread = threading.Thread(target=renew)
    thread.start()
    return thread
