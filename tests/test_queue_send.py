"""Sending to queues: message contents, ids, sizes, partition placement, sequence numbers, batches,
duplicate detection, scheduling and time-to-live (docs/semantics.md §2, §3, §4, §5, §10)."""

from __future__ import annotations

import glob
import itertools
import os
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from procs import drain, drain_all, key_for_partition, partition_for, peek_all, sleep_past

from sparkqueue import Message, Namespace, SubQueue
from sparkqueue.errors import (
    InvalidArgumentTypeError,
    InvalidOperationError,
    MessageSizeExceededError,
    PartitionUnavailableError,
    QuotaExceededError,
)

KB = 1024


def _stored_count(ns: Namespace, queue: str = "q") -> int:
    """Messages stored in the queue, counted by runtime properties and cross-checked by browsing."""
    total = ns.get_queue_runtime_properties(queue).total_message_count
    with ns.get_queue_receiver(queue) as r:
        assert len(peek_all(r)) == total
    return total


# ---- message contents ------------------------------------------------------------------------


def test_str_body_is_stored_as_utf8(ns: Namespace) -> None:
    """A str body is stored as UTF-8 and received as bytes; str(msg) decodes it."""
    ns.create_queue("q")
    text = "héllo wörld ✓ 日本"
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message(text))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert isinstance(m.body, bytes)
    assert m.body == text.encode("utf-8")
    assert str(m) == text


def test_bytes_body_round_trips(ns: Namespace) -> None:
    """A bytes body (any byte values, also empty) comes back unchanged."""
    ns.create_queue("q", enable_partitioning=False)
    bodies = [bytes(range(256)), b"", bytearray(b"\x00\xff")]
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(b) for b in bodies])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
    assert [m.body for m in got] == [bytes(b) for b in bodies]


def test_message_properties_round_trip(ns: Namespace) -> None:
    """Broker and application properties set on send are those received, with their value types."""
    ns.create_queue("q")
    props = {"s": "text", "i": 42, "f": 1.5, "b": True, "n": None}
    msg = Message(
        "x",
        message_id="mid-1",
        partition_key="pk",
        application_properties=props,
        content_type="application/json",
        correlation_id="corr",
        subject="subj",
        to="dest",
        reply_to="back",
        reply_to_session_id="rs",
        time_to_live=timedelta(hours=1),
    )
    with ns.get_queue_sender("q") as s:
        s.send_messages(msg)
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert m.message_id == "mid-1"
    assert m.partition_key == "pk"
    assert m.application_properties == props
    assert type(m.application_properties["i"]) is int
    assert type(m.application_properties["b"]) is bool
    assert (m.content_type, m.correlation_id, m.subject, m.to, m.reply_to, m.reply_to_session_id) == (
        "application/json",
        "corr",
        "subj",
        "dest",
        "back",
        "rs",
    )
    assert m.time_to_live == timedelta(hours=1)
    assert m.state == "active"
    assert m.dead_letter_reason is None


def test_missing_message_id_is_assigned_a_uuid(ns: Namespace) -> None:
    """A message sent without message_id gets a distinct UUID; a given message_id is kept."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a"), Message("b")])
        s.send_messages(Message("c", message_id="mine"))
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
    ids = {str(m): m.message_id for m in got}
    assert ids["c"] == "mine"
    assert ids["a"] != ids["b"]
    for key in ("a", "b"):
        assert str(uuid.UUID(ids[key])) == ids[key]


@pytest.mark.parametrize("field", ["message_id", "session_id", "partition_key"])
def test_keys_up_to_128_characters(ns: Namespace, field: str) -> None:
    """message_id, session_id and partition_key may have 128 characters; 129 is refused."""
    ns.create_queue("q")
    ok = "k" * 128
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", **{field: ok}))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert getattr(m, field) == ok
    with pytest.raises(InvalidOperationError):
        Message("x", **{field: "k" * 129})


def test_message_over_256kb_is_refused_in_standard_tier(ns: Namespace) -> None:
    """A body over 256 KB raises MessageSizeExceededError and stores nothing; 256 KB exactly is accepted."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(MessageSizeExceededError):
            s.send_messages(Message(b"x" * (256 * KB + 1)))
        assert _stored_count(ns) == 0
        s.send_messages(Message(b"y" * (256 * KB)))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert len(m.body) == 256 * KB


def test_message_size_counts_properties(ns: Namespace) -> None:
    """Application properties count towards the size limit: a small body with large properties is refused."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s, pytest.raises(MessageSizeExceededError):
        s.send_messages(Message(b"x" * (200 * KB), application_properties={"big": "p" * (60 * KB)}))
    assert _stored_count(ns) == 0


def test_received_size_is_the_sent_size_in_a_mixed_batch(ns: Namespace) -> None:
    """A batch mixing bare, keyed, scheduled, expiring and property-laden messages stores each one's size_in_bytes
    and properties as the message itself reports them (the batch conversion is column-wise)."""
    ns.create_queue("q")
    now = datetime.now(UTC)
    sent = [
        Message(b"plain"),
        Message("h\u00e9llo \u2603", message_id="id-\u00e9", correlation_id="c\u00fc", subject="s", to="t"),
        Message(b"k" * 10, partition_key="pk-1", content_type="text/plain", reply_to="r", reply_to_session_id="rs"),
        Message(b"p", application_properties={"n": 1, "s": "\u00e4\u00f6", "f": 1.5}),
        Message(b"ttl", time_to_live=timedelta(hours=1)),
        Message(b"sched", scheduled_enqueue_time_utc=now - timedelta(seconds=1)),
    ]
    with ns.get_queue_sender("q") as s:
        s.send_messages(sent)
    with ns.get_queue_receiver("q") as r:
        got = {m.body: m for m in drain(r, len(sent))}
    for m in sent:
        g = got[m.body]
        assert g.size_in_bytes == m.size_in_bytes
        assert (g.correlation_id, g.subject, g.to, g.partition_key) == (m.correlation_id, m.subject, m.to, m.partition_key)
        assert (g.content_type, g.reply_to, g.reply_to_session_id) == (m.content_type, m.reply_to, m.reply_to_session_id)
        assert dict(g.application_properties or {}) == (m.application_properties or {})
        assert g.time_to_live == m.time_to_live
    assert got["h\u00e9llo \u2603".encode()].message_id == "id-\u00e9"
    assert got[b"ttl"].expires_at_utc == got[b"ttl"].enqueued_time_utc + timedelta(hours=1)
    assert got[b"plain"].expires_at_utc is None


def test_premium_allows_messages_over_256kb(premium_ns: Namespace) -> None:
    """The premium tier accepts a 1 MB message (its limit is 100 MB)."""
    premium_ns.create_queue("q")
    body = bytes(range(256)) * (4 * KB)  # 1 MB
    with premium_ns.get_queue_sender("q") as s:
        s.send_messages(Message(body))
    with premium_ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert m.body == body


# ---- partition placement ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["order-1", "customer/42", "ключ", "x" * 128])
def test_partition_key_placement_uses_mmh3(ns: Namespace, key: str) -> None:
    """A keyed message lands in mmh3(key, seed 0, unsigned) % 16, and its sequence number's top 16 bits say so."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        (seq,) = s.send_messages(Message("x", partition_key=key))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    expected = partition_for(key)
    assert m.partition_id == expected
    assert m.sequence_number == seq
    assert seq >> 48 == expected


def test_session_id_places_message_and_wins_over_equal_partition_key(ns: Namespace) -> None:
    """session_id is the partition key; an equal partition_key is allowed."""
    ns.create_queue("q")
    sid = key_for_partition(7, "session")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a", session_id=sid), Message("b", session_id=sid, partition_key=sid)])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 2)
    assert {m.partition_id for m in got} == {7}
    assert {m.session_id for m in got} == {sid}


def test_session_id_with_different_partition_key_is_refused(ns: Namespace) -> None:
    """session_id with a differing partition_key raises InvalidOperationError and stores nothing (also in a list)."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError):
            s.send_messages(Message("x", session_id="s1", partition_key="other"))
        with pytest.raises(InvalidOperationError):
            s.send_messages([Message("ok", partition_key="p"), Message("x", session_id="s1", partition_key="other")])
    assert _stored_count(ns) == 0


def test_message_id_is_the_key_only_with_duplicate_detection(ns: Namespace) -> None:
    """On a duplicate-detecting queue the message_id places the message; elsewhere unkeyed messages rotate."""
    ns.create_queue("dedupe", requires_duplicate_detection=True)
    ns.create_queue("plain")
    ids = [f"id-{i}" for i in range(20)]
    with ns.get_queue_sender("dedupe") as s:
        seqs = [s.send_messages(Message("x", message_id=i))[0] for i in ids]
    assert [seq >> 48 for seq in seqs] == [partition_for(i) for i in ids]
    with ns.get_queue_sender("plain") as s:
        plain = [s.send_messages(Message("x", message_id="same-id"))[0] for _ in range(16)]
    assert sorted(seq >> 48 for seq in plain) == list(range(16)), "16 unkeyed sends cover all 16 partitions"


def test_partition_key_wins_over_message_id_on_duplicate_detection_queue(ns: Namespace) -> None:
    """With duplicate detection, a partition_key still takes precedence over the message_id."""
    ns.create_queue("q", requires_duplicate_detection=True)
    pk = key_for_partition(3, "pk")
    mid = key_for_partition(9, "mid")
    with ns.get_queue_sender("q") as s:
        (seq,) = s.send_messages(Message("x", message_id=mid, partition_key=pk))
    assert seq >> 48 == 3


def test_requires_session_queue_refuses_message_without_session(ns: Namespace) -> None:
    """A session-enabled queue raises InvalidOperationError for a message without session_id, storing nothing."""
    ns.create_queue("q", requires_session=True)
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError):
            s.send_messages(Message("x"))
        with pytest.raises(InvalidOperationError):
            s.send_messages([Message("ok", session_id="s"), Message("no session")])
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_unkeyed_sends_round_robin_over_partitions(ns: Namespace) -> None:
    """Unkeyed sends spread round-robin: 32 single sends use every partition twice."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        seqs = [s.send_messages(Message(f"m{i}"))[0] for i in range(32)]
    parts = [seq >> 48 for seq in seqs]
    assert sorted(parts) == sorted(list(range(16)) * 2)
    assert all((b - a) % 16 == 1 for a, b in itertools.pairwise(parts)), parts


def test_unkeyed_send_fails_over_to_available_partitions(ns: Namespace) -> None:
    """With all but two partitions unavailable, unkeyed sends all succeed and land on the available ones."""
    ns.create_queue("q")
    faults = ns.fault_injector("q")
    for p in range(16):
        if p not in (4, 11):
            faults.fail(p, ("read", "write"))
    with ns.get_queue_sender("q") as s:
        seqs = [s.send_messages(Message(f"m{i}"))[0] for i in range(10)]
    assert {seq >> 48 for seq in seqs} == {4, 11}
    faults.heal()
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 10)
    assert sorted(m.sequence_number for m in got) == sorted(seqs)


def test_unkeyed_send_with_no_partition_available_fails(ns: Namespace) -> None:
    """When no partition is available an unkeyed send raises PartitionUnavailableError."""
    ns.create_queue("q")
    faults = ns.fault_injector("q")
    for p in range(16):
        faults.fail(p, ("read", "write"))
    with ns.get_queue_sender("q") as s, pytest.raises(PartitionUnavailableError):
        s.send_messages(Message("x"))
    faults.heal()
    assert _stored_count(ns) == 0


def test_keyed_send_to_unavailable_partition_fails(ns: Namespace) -> None:
    """A key pins its partition: if that partition is unavailable the send fails and nothing is stored."""
    ns.create_queue("q")
    down = key_for_partition(5, "down")
    up = key_for_partition(6, "up")
    faults = ns.fault_injector("q")
    faults.fail(5, ("read", "write"))
    with ns.get_queue_sender("q") as s:
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("x", partition_key=down))
        with pytest.raises(PartitionUnavailableError):
            s.send_messages([Message("y", partition_key=up), Message("x", partition_key=down)])
        (seq,) = s.send_messages(Message("z", partition_key=up))
    assert seq >> 48 == 6
    faults.heal()
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert [str(m) for m in got] == ["z"]


def test_keyed_send_with_only_write_fault_fails(ns: Namespace) -> None:
    """A write fault alone makes the keyed partition unavailable for sends."""
    ns.create_queue("q")
    key = key_for_partition(2, "w")
    ns.fault_injector("q").fail(2, ("write",))
    with ns.get_queue_sender("q") as s, pytest.raises(PartitionUnavailableError):
        s.send_messages(Message("x", partition_key=key))
    ns.fault_injector("q").heal()
    assert _stored_count(ns) == 0


def test_non_partitioned_queue_has_one_partition(ns: Namespace) -> None:
    """enable_partitioning=False gives one partition: every message, keyed or not, is in partition 0."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        seqs = s.send_messages([Message("a", partition_key="k1"), Message("b", partition_key="k2")])
        seqs += [s.send_messages(Message(f"u{i}"))[0] for i in range(5)]
    assert all(seq >> 48 == 0 for seq in seqs)
    assert seqs == sorted(seqs)
    rp = ns.get_queue_runtime_properties("q")
    assert [p.partition_id for p in rp.partitions] == [0]
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 7)
    assert {m.partition_id for m in got} == {0}


def test_premium_queue_has_one_partition_even_when_partitioning_requested(premium_ns: Namespace) -> None:
    """In the premium tier enable_partitioning=True is accepted but the queue gets a single partition."""
    premium_ns.create_queue("q", enable_partitioning=True)
    with premium_ns.get_queue_sender("q") as s:
        seqs = [s.send_messages(Message(f"m{i}", partition_key=f"k{i}"))[0] for i in range(8)]
    assert {seq >> 48 for seq in seqs} == {0}
    assert len(premium_ns.get_queue_runtime_properties("q").partitions) == 1


# ---- sequence numbers and batches -------------------------------------------------------------


def test_sequence_numbers_strictly_increase_per_partition(ns: Namespace) -> None:
    """Within a partition, sequence numbers strictly increase in enqueue order (single sends and batches)."""
    ns.create_queue("q")
    keys = [key_for_partition(p, "seq") for p in (1, 8)]
    sent: dict[str, list[int]] = {k: [] for k in keys}
    with ns.get_queue_sender("q") as s:
        for i in range(6):
            for k in keys:
                sent[k] += s.send_messages([Message(f"{k}-{i}-{j}", partition_key=k) for j in range(3)])
    for k, seqs in sent.items():
        assert len(seqs) == 18
        assert all(a < b for a, b in itertools.pairwise(seqs))
        assert {seq >> 48 for seq in seqs} == {partition_for(k)}
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 36)
    assert sorted(m.sequence_number for m in got) == sorted(sent[keys[0]] + sent[keys[1]])


def test_batch_send_is_atomic(ns: Namespace) -> None:
    """A list with one invalid message raises and stores none of the list."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(MessageSizeExceededError):
            s.send_messages([Message("a"), Message("b"), Message(b"x" * (300 * KB))])
        with pytest.raises(InvalidOperationError):
            s.send_messages([Message("a"), "not a message"])  # type: ignore[list-item]
    assert _stored_count(ns) == 0


def test_batch_across_partitions_is_stored_in_full(ns: Namespace) -> None:
    """A list whose messages have keys of different partitions is stored completely, each in its partition."""
    ns.create_queue("q")
    keys = [key_for_partition(p, "multi") for p in range(0, 16, 3)]
    with ns.get_queue_sender("q") as s:
        seqs = s.send_messages([Message(k, partition_key=k) for k in keys])
    assert sorted(seq >> 48 for seq in seqs) == list(range(0, 16, 3))
    with ns.get_queue_receiver("q") as r:
        got = drain(r, len(keys))
    assert {(str(m), m.partition_id) for m in got} == {(k, partition_for(k)) for k in keys}


def test_message_batch_limits_size(ns: Namespace) -> None:
    """add_message raises MessageSizeExceededError (also a ValueError) when full; len() counts; the batch sends."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        batch = s.create_message_batch(max_size_in_bytes=1000)
        assert len(batch) == 0
        for i in range(3):
            batch.add_message(Message(b"x" * 300, message_id=f"m{i}"))
        assert len(batch) == 3
        with pytest.raises(MessageSizeExceededError):
            batch.add_message(Message(b"x" * 300))
        with pytest.raises(ValueError):
            batch.add_message(Message(b"x" * 300))
        assert len(batch) == 3
        s.send_messages(batch)
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert sorted(m.message_id for m in got) == ["m0", "m1", "m2"]


def test_default_message_batch_is_bounded_by_tier_limit(ns: Namespace) -> None:
    """A batch without an explicit size holds at most 256 KB in the standard tier."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        batch = s.create_message_batch()
        batch.add_message(Message(b"a" * (200 * KB)))
        with pytest.raises(MessageSizeExceededError):
            batch.add_message(Message(b"b" * (100 * KB)))
        assert len(batch) == 1


# ---- duplicate detection ---------------------------------------------------------------------


def test_duplicate_message_id_is_stored_once(ns: Namespace) -> None:
    """With duplicate detection, a repeated message_id is dropped: the send succeeds and stores nothing new."""
    ns.create_queue("q", requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s:
        assert len(s.send_messages(Message("first", message_id="dup"))) == 1
        assert s.send_messages(Message("second", message_id="dup")) == []
        stored = s.send_messages([Message("third", message_id="dup"), Message("other", message_id="new")])
    assert len(stored) == 1
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert sorted(str(m) for m in got) == ["first", "other"]


def test_duplicates_within_one_batch_are_stored_once(ns: Namespace) -> None:
    """A batch repeating a message_id stores it once (the first occurrence)."""
    ns.create_queue("q", requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a", message_id="x"), Message("b", message_id="x"), Message("c", message_id="y")])
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert sorted(str(m) for m in got) == ["a", "c"]


def test_duplicate_detected_after_completion(ns: Namespace) -> None:
    """An id stays known after its message was completed: resending it stores nothing."""
    ns.create_queue("q", requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s, ns.get_queue_receiver("q") as r:
        s.send_messages(Message("once", message_id="done-id"))
        (m,) = drain(r, 1)
        r.complete_message(m)
        assert s.send_messages(Message("again", message_id="done-id")) == []
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_duplicate_detected_after_receive_and_delete(ns: Namespace) -> None:
    """An id received in RECEIVE_AND_DELETE mode is still detected as a duplicate."""
    from sparkqueue import ReceiveMode

    ns.create_queue("q", requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s, ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        s.send_messages(Message("once", message_id="rd-id"))
        assert len(drain(r, 1)) == 1
        assert s.send_messages(Message("again", message_id="rd-id")) == []
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []


def test_duplicate_of_scheduled_message_is_dropped(ns: Namespace) -> None:
    """A scheduled message's id counts for duplicate detection: an immediate resend is dropped."""
    ns.create_queue("q", requires_duplicate_detection=True)
    later = datetime.now(UTC) + timedelta(minutes=5)
    with ns.get_queue_sender("q") as s:
        assert len(s.schedule_messages(Message("later", message_id="sched"), later)) == 1
        assert s.send_messages(Message("now", message_id="sched")) == []
    rp = ns.get_queue_runtime_properties("q")
    assert (rp.scheduled_message_count, rp.active_message_count, rp.total_message_count) == (1, 0, 1)


def test_duplicate_detection_off_stores_repeats(ns: Namespace) -> None:
    """Without duplicate detection the same message_id is stored every time."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        for _ in range(3):
            s.send_messages(Message("x", message_id="same"))
    assert _stored_count(ns) == 3


def test_duplicate_detection_on_non_partitioned_queue(ns: Namespace) -> None:
    """Duplicate detection works on a queue with one partition too."""
    ns.create_queue("q", enable_partitioning=False, requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s:
        for i in range(3):
            s.send_messages([Message("x", message_id=f"id{i}"), Message("x", message_id="id0")])
    assert _stored_count(ns) == 3


def test_a_session_state_row_is_no_accepted_message_id(ns: Namespace) -> None:
    """Duplicate detection counts messages only: a message whose id is a session state row's internal id is stored."""
    ns.create_queue("q", enable_partitioning=False, requires_session=True, requires_duplicate_detection=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", session_id="a"))
    with ns.get_queue_receiver("q", session_id="a") as r:
        r.session.set_state(b"kept")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("y", session_id="a", message_id="$session/a"))
    with ns.get_queue_receiver("q", session_id="a") as r:
        assert sorted(m.body for m in r.receive_messages(5, max_wait_time=1)) == [b"x", b"y"]


@pytest.mark.slow
def test_id_is_accepted_again_after_the_detection_window(ns: Namespace) -> None:
    """Once the detection window (20 s here) has passed since the first send, the same id is stored again."""
    ns.create_queue("q", requires_duplicate_detection=True, duplicate_detection_history_time_window=timedelta(seconds=20))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("one", message_id="w"))
        assert s.send_messages(Message("dup", message_id="w")) == []
        time.sleep(21)
        assert len(s.send_messages(Message("two", message_id="w"))) == 1
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert sorted(str(m) for m in got) == ["one", "two"]


# ---- scheduled messages ----------------------------------------------------------------------


def test_scheduled_message_is_invisible_until_due(ns: Namespace) -> None:
    """A message with scheduled_enqueue_time_utc is not received before its time, and is afterwards."""
    ns.create_queue("q")
    due = datetime.now(UTC) + timedelta(seconds=3)
    with ns.get_queue_sender("q") as s:
        (seq,) = s.send_messages(Message("later", scheduled_enqueue_time_utc=due))
    with ns.get_queue_receiver("q") as r:
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
        (peeked,) = r.peek_messages(5)
        assert peeked.state == "scheduled"
        assert peeked.sequence_number == seq
        assert ns.get_queue_runtime_properties("q").scheduled_message_count == 1
        got = r.receive_messages(max_message_count=5, max_wait_time=10)
        assert datetime.now(UTC) >= due
    assert [str(m) for m in got] == ["later"]
    assert got[0].scheduled_enqueue_time_utc == due
    assert got[0].state == "active"
    assert ns.get_queue_runtime_properties("q").scheduled_message_count == 0


def test_scheduled_message_ttl_counts_from_its_enqueue_time(ns: Namespace) -> None:
    """A scheduled message expires at enqueued_time_utc + ttl, so a TTL shorter than the delay does not kill it early."""
    ns.create_queue("q")
    due = datetime.now(UTC) + timedelta(seconds=2)
    ttl = timedelta(seconds=1.5)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("sched-ttl", scheduled_enqueue_time_utc=due, time_to_live=ttl))
    with ns.get_queue_receiver("q") as r:
        (peeked,) = r.peek_messages(1)
        assert peeked.expires_at_utc == peeked.enqueued_time_utc + ttl
        sleep_past(due, margin_s=0.05)
        got = r.receive_messages(max_message_count=1, max_wait_time=1)
    assert [str(m) for m in got] == ["sched-ttl"]
    assert got[0].expires_at_utc == got[0].enqueued_time_utc + ttl


def test_schedule_messages_returns_sequence_numbers_and_cancel_removes(ns: Namespace) -> None:
    """schedule_messages returns one sequence number per message; cancel_scheduled_messages removes them."""
    ns.create_queue("q")
    due = datetime.now(UTC) + timedelta(seconds=3)
    with ns.get_queue_sender("q") as s:
        seqs = s.schedule_messages([Message("a"), Message("b"), Message("c")], due)
        (single,) = s.schedule_messages(Message("d"), due)
        assert len(seqs) == 3
        assert ns.get_queue_runtime_properties("q").scheduled_message_count == 4
        s.cancel_scheduled_messages(seqs[:2])
        s.cancel_scheduled_messages(single)
    assert ns.get_queue_runtime_properties("q").scheduled_message_count == 1
    with ns.get_queue_receiver("q") as r:
        assert [m.sequence_number for m in peek_all(r)] == [seqs[2]]
        sleep_past(due)
        got = drain_all(r)
    assert [m.sequence_number for m in got] == [seqs[2]]
    assert str(got[0]) == "c"


def test_returned_numbers_follow_the_order_of_the_messages(ns: Namespace) -> None:
    """send_messages and schedule_messages return each message's number in the order given, though keyed messages
    land in different partitions (so `zip(messages, numbers)` pairs them); a dropped duplicate has none."""
    ns.create_queue("q", requires_duplicate_detection=True)
    parts = [7, 2, 11, 2, 0]
    msgs = [Message(str(i), message_id=f"m{i}", partition_key=key_for_partition(p, f"k{i}")) for i, p in enumerate(parts)]
    with ns.get_queue_sender("q") as s:
        seqs = s.send_messages([*msgs, Message("again", message_id="m2", partition_key=msgs[2].partition_key)])
        later = s.schedule_messages(list(reversed(msgs[:3])), datetime.now(UTC) + timedelta(minutes=5))
    assert [n >> 48 for n in seqs] == parts
    assert later == []  # the same ids again: all three are duplicates within the window
    with ns.get_queue_receiver("q") as r:
        by_number = {m.sequence_number: m.message_id for m in peek_all(r)}
    assert [by_number[n] for n in seqs] == [m.message_id for m in msgs]
    ns.create_queue("plain")
    with ns.get_queue_sender("plain") as s:
        numbers = s.schedule_messages(list(reversed(msgs)), datetime.now(UTC) + timedelta(minutes=5))
    assert [n >> 48 for n in numbers] == list(reversed(parts))


def test_messages_sharing_an_id_in_different_partitions_get_their_own_numbers(ns: Namespace) -> None:
    """Two messages with one id but keys of different partitions: each gets its own number, in the order given, so
    cancelling the first one's cancels that message (the store returns rows in partition order)."""
    ns.create_queue("q")
    high, low = key_for_partition(15, "hi"), key_for_partition(0, "lo")
    when = datetime.now(UTC) + timedelta(hours=1)
    with ns.get_queue_sender("q") as s:
        seqs = s.schedule_messages(
            [Message("first", message_id="same", partition_key=high), Message("second", message_id="same", partition_key=low)],
            when,
        )
        sent = s.send_messages(
            [Message("A", message_id="dup", partition_key=high), Message("B", message_id="dup", partition_key=low)]
        )
        with ns.get_queue_receiver("q") as r:
            by_number = {m.sequence_number: str(m) for m in peek_all(r)}
        assert [by_number[n] for n in seqs] == ["first", "second"]
        assert [by_number[n] for n in sent] == ["A", "B"]
        s.cancel_scheduled_messages(seqs[0])
    with ns.get_queue_receiver("q") as r:
        assert sorted(str(m) for m in peek_all(r)) == ["A", "B", "second"]


def test_naive_schedule_time_is_read_as_utc(ns: Namespace) -> None:
    """A naive datetime given as schedule time (or scheduled_enqueue_time_utc) is read as UTC."""
    ns.create_queue("q")
    naive = datetime.now(UTC).replace(tzinfo=None) + timedelta(minutes=10)
    with ns.get_queue_sender("q") as s:
        s.schedule_messages(Message("n1"), naive)
        s.send_messages(Message("n2", scheduled_enqueue_time_utc=naive))
    with ns.get_queue_receiver("q") as r:
        peeked = peek_all(r)
        assert r.receive_messages(max_message_count=2) == []
    assert sorted(str(m) for m in peeked) == ["n1", "n2"]
    for m in peeked:
        assert m.scheduled_enqueue_time_utc == naive.replace(tzinfo=UTC)
        assert m.state == "scheduled"


def test_schedule_time_in_the_past_is_delivered_at_once(ns: Namespace) -> None:
    """A scheduled time already passed makes the message available immediately."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("past", scheduled_enqueue_time_utc=datetime.now(UTC) - timedelta(minutes=1)))
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in r.receive_messages(max_message_count=1, max_wait_time=2)] == ["past"]


def test_cancel_does_not_remove_a_visible_message(ns: Namespace) -> None:
    """cancel_scheduled_messages leaves messages that are already visible (not scheduled) alone."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        (seq,) = s.send_messages(Message("now"))
        s.cancel_scheduled_messages([seq])
    with ns.get_queue_receiver("q") as r:
        assert [m.sequence_number for m in drain(r, 1)] == [seq]


# ---- time to live ----------------------------------------------------------------------------


def test_expired_message_is_not_delivered_and_dropped(ns: Namespace) -> None:
    """A message past its time_to_live is never delivered; without dead-lettering it is dropped."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("short", time_to_live=timedelta(seconds=1)), Message("long")])
    time.sleep(1.2)
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert [str(m) for m in got] == ["long"]
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert drain_all(dlq) == []
    rp = ns.get_queue_runtime_properties("q")
    assert (rp.dead_letter_message_count, rp.total_message_count) == (0, 1), "the expired message must be gone"


def test_expired_message_is_dead_lettered_when_configured(ns: Namespace) -> None:
    """With dead_lettering_on_message_expiration an expired message moves to the DLQ with reason TTLExpiredException."""
    ns.create_queue("q", dead_lettering_on_message_expiration=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("short", message_id="ttl", time_to_live=timedelta(seconds=1)))
    time.sleep(1.2)
    with ns.get_queue_receiver("q") as r:
        assert drain_all(r) == []
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert m.message_id == "ttl"
    assert m.dead_letter_reason == "TTLExpiredException"
    assert m.dead_letter_source == "q"


@pytest.mark.parametrize("session", [None, "s"])
def test_a_receive_of_one_behind_expired_messages_returns_the_live_one_in_a_few_commits(
    ns: Namespace, root: str, session: str | None
) -> None:
    """Before, each receive(1) dead-lettered one expired message and came back empty (a session receive), or made a
    commit per expired message (300 here); the messages in front are dead-lettered by the receive that passes them."""
    ns.create_queue("q", enable_partitioning=False, requires_session=bool(session), dead_lettering_on_message_expiration=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"e{i}", session_id=session, time_to_live=timedelta(seconds=1)) for i in range(300)])
        time.sleep(1.2)
        s.send_messages(Message("live", session_id=session))
    (log_dir,) = glob.glob(f"{root}/entities/*/_delta_log")
    entries = len(os.listdir(log_dir))
    with ns.get_queue_receiver("q", session_id=session, max_wait_time=1) as r:
        assert [str(m) for m in r.receive_messages(1)] == ["live"]
    assert len(os.listdir(log_dir)) - entries <= 8
    assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 300


def test_entity_default_ttl_applies_and_smaller_ttl_wins(ns: Namespace) -> None:
    """expires_at = enqueued + min(message ttl, entity default ttl)."""
    ns.create_queue("q", default_message_time_to_live=timedelta(hours=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages(
            [
                Message("none", message_id="none"),
                Message("shorter", message_id="shorter", time_to_live=timedelta(minutes=5)),
                Message("longer", message_id="longer", time_to_live=timedelta(days=2)),
            ]
        )
    with ns.get_queue_receiver("q") as r:
        got = {m.message_id: m for m in peek_all(r)}
    for mid, ttl in (("none", timedelta(hours=1)), ("shorter", timedelta(minutes=5)), ("longer", timedelta(hours=1))):
        m = got[mid]
        assert m.expires_at_utc == m.enqueued_time_utc + ttl, mid


def test_entity_default_ttl_expires_messages(ns: Namespace) -> None:
    """A short entity default TTL expires a message sent with a longer one."""
    ns.create_queue("q", default_message_time_to_live=timedelta(seconds=1), dead_lettering_on_message_expiration=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", time_to_live=timedelta(hours=1)))
    time.sleep(1.2)
    with ns.get_queue_receiver("q") as r:
        assert drain_all(r) == []
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert m.dead_letter_reason == "TTLExpiredException"


def test_message_without_ttl_never_expires(ns: Namespace) -> None:
    """With no message TTL and the entity default (never), expires_at_utc is None."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
    assert m.expires_at_utc is None
    assert m.time_to_live is None


# ---- size quota --------------------------------------------------------------------------------


@pytest.mark.slow
def test_send_beyond_partition_size_raises_quota_exceeded(premium_ns: Namespace) -> None:
    """A send that would take a partition past max_size_in_megabytes raises QuotaExceededError and stores nothing."""
    premium_ns.create_queue("q", max_size_in_megabytes=1024)
    body = os.urandom(100 * 1024 * 1024 - 1024)  # incompressible, just under the premium message limit
    with premium_ns.get_queue_sender("q") as s:
        for i in range(10):  # about 1000 MB: still within the 1024 MB partition
            s.send_messages(Message(body, message_id=f"big-{i}"))
        before = premium_ns.get_queue_runtime_properties("q")
        assert before.total_message_count == 10
        with pytest.raises(QuotaExceededError):
            s.send_messages([Message(b"small"), Message(body, message_id="one-too-many")])
        s.send_messages(Message(b"tiny", message_id="fits"))
    after = premium_ns.get_queue_runtime_properties("q")
    assert after.total_message_count == 11
    with premium_ns.get_queue_receiver("q") as r:
        ids = {m.message_id for m in peek_all(r)}
    assert "one-too-many" not in ids
    assert "fits" in ids


def test_a_bulk_batch_larger_than_the_sdk_limit_is_one_atomic_send(ns: Namespace) -> None:
    """send_messages(list) keeps the SDK's one-batch limit; a batch asked larger than 256 KB sends 1,000 x 1 KB at once."""
    from sparkqueue.errors import MessageSizeExceededError

    ns.create_queue("q")
    msgs = [Message(b"x" * 1024, partition_key="k") for _ in range(1000)]
    with ns.get_queue_sender("q") as s:
        with pytest.raises(MessageSizeExceededError):
            s.send_messages(msgs)
        assert ns.get_queue_runtime_properties("q").active_message_count == 0
        batch = s.create_message_batch(max_size_in_bytes=2 * 1024 * 1024)
        for m in msgs:
            batch.add_message(m)
        with pytest.raises(MessageSizeExceededError):
            batch.add_message(Message(b"x" * (300 * 1024)))  # each message still within the tier's limit
        seqs = s.send_messages(batch)
    assert len(seqs) == 1000 and seqs == sorted(seqs)
    assert ns.get_queue_runtime_properties("q").active_message_count == 1000


def test_cancel_scheduled_messages_takes_numbers_only(ns: Namespace) -> None:
    """As receive_deferred_messages: a number or any iterable of numbers; anything else is a clear type error."""
    ns.create_queue("q")
    when = datetime.now(UTC) + timedelta(hours=1)
    with ns.get_queue_sender("q") as s:
        seqs = s.schedule_messages([Message("a"), Message("b"), Message("c")], when)
        s.cancel_scheduled_messages({seqs[0]})
        s.cancel_scheduled_messages(n for n in seqs[1:])
        assert ns.get_queue_runtime_properties("q").scheduled_message_count == 0
        for bad in (None, "12", 1.5):
            with pytest.raises(InvalidArgumentTypeError, match="sequence_numbers must be an int"):
                s.cancel_scheduled_messages(bad)  # type: ignore[arg-type]
