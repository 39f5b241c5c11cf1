"""Settling messages: complete, abandon, defer, dead-letter, renew, lost locks, delivery limits and
the dead-letter sub-queue (docs/semantics.md §5)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from procs import drain, drain_all, key_for_partition, peek_all, sleep_past

from sparkqueue import EntityStatus, Message, Namespace, ReceivedMessage, ReceiveMode, SubQueue
from sparkqueue.errors import (
    InvalidOperationError,
    MessageLockLostError,
    MessageNotFoundError,
    MessagingEntityDisabledError,
    PartitionUnavailableError,
)
from sparkqueue.receiver import Receiver


def _send(ns: Namespace, msgs: list[Message], queue: str = "q") -> list[int]:
    with ns.get_queue_sender(queue) as s:
        return s.send_messages(msgs)


def _one(receiver: Receiver) -> ReceivedMessage:
    (m,) = drain(receiver, 1)
    return m


def _counts(ns: Namespace, queue: str = "q") -> tuple[int, int, int, int, int]:
    """(active, deferred, dead-letter, scheduled, total) from runtime properties."""
    rp = ns.get_queue_runtime_properties(queue)
    return (
        rp.active_message_count,
        rp.deferred_message_count,
        rp.dead_letter_message_count,
        rp.scheduled_message_count,
        rp.total_message_count,
    )


# ---- complete, abandon, defer, dead-letter, renew -----------------------------------------------


def test_complete_removes_the_message(ns: Namespace) -> None:
    """complete_message removes the message: it is not received, browsed or counted again."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        r.complete_message(_one(r))
        assert r.receive_messages(max_message_count=1, max_wait_time=0.3) == []
        assert peek_all(r) == []
    assert _counts(ns) == (0, 0, 0, 0, 0)


def test_abandon_makes_the_message_available_at_once(ns: Namespace) -> None:
    """abandon_message releases the lock: the next receive gets it with delivery_count + 1."""
    ns.create_queue("q", lock_duration=timedelta(minutes=5))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r, ns.get_queue_receiver("q") as other:
        m1 = _one(r)
        assert m1.delivery_count == 0
        r.abandon_message(m1)
        (m2,) = other.receive_messages(max_message_count=1)
    assert m2.sequence_number == m1.sequence_number
    assert m2.delivery_count == 1


def test_defer_sets_the_message_aside(ns: Namespace) -> None:
    """A deferred message is not received normally; receive_deferred_messages delivers it by sequence number."""
    ns.create_queue("q")
    (seq,) = _send(ns, [Message("later")])
    with ns.get_queue_receiver("q") as r:
        r.defer_message(_one(r))
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
        assert _counts(ns) == (0, 1, 0, 0, 1)
        (d,) = r.receive_deferred_messages([seq])
        assert d.state == "deferred"
        assert d.lock_token is not None
        assert d.delivery_count == 1
        r.complete_message(d)
    assert _counts(ns) == (0, 0, 0, 0, 0)


def test_receive_deferred_refuses_messages_that_are_not_deferred(ns: Namespace) -> None:
    """receive_deferred_messages raises MessageNotFoundError for active or unknown sequence numbers (as the SDK) and
    changes nothing."""
    ns.create_queue("q")
    (seq,) = _send(ns, [Message("active")])
    with ns.get_queue_receiver("q") as r:
        with pytest.raises(MessageNotFoundError):
            r.receive_deferred_messages([seq, seq + 100])
        assert [m.sequence_number for m in drain(r, 1)] == [seq]


def test_deferred_message_locked_by_one_receiver_is_not_given_to_another(ns: Namespace) -> None:
    """A deferred message received by one receiver is locked: a second receive_deferred_messages gets nothing."""
    ns.create_queue("q")
    (seq,) = _send(ns, [Message("d")])
    with ns.get_queue_receiver("q") as r, ns.get_queue_receiver("q") as other:
        r.defer_message(_one(r))
        (d,) = r.receive_deferred_messages(seq)
        assert other.receive_deferred_messages([seq]) == []
        r.abandon_message(d)
        (again,) = other.receive_deferred_messages([seq])
        assert again.state == "deferred"
        assert other.receive_messages(max_message_count=1, max_wait_time=0.2) == []


def test_dead_letter_moves_message_to_dlq_with_reason(ns: Namespace) -> None:
    """dead_letter_message moves it to the DLQ, which reports reason, description and source."""
    ns.create_queue("q")
    _send(ns, [Message("bad", message_id="m1", application_properties={"k": 1})])
    with ns.get_queue_receiver("q") as r:
        r.dead_letter_message(_one(r), reason="Poison", error_description="could not parse")
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
    assert _counts(ns) == (0, 0, 1, 0, 1)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        m = _one(dlq)
        assert (m.message_id, str(m)) == ("m1", "bad")
        # Service Bus also records the reason and description among the dead letter's application properties
        assert m.application_properties == {"k": 1, "DeadLetterReason": "Poison", "DeadLetterErrorDescription": "could not parse"}
        assert m.dead_letter_reason == "Poison"
        assert m.dead_letter_error_description == "could not parse"
        assert m.dead_letter_source == "q"
        dlq.complete_message(m)
    assert _counts(ns) == (0, 0, 0, 0, 0)


def test_dead_letter_without_reason(ns: Namespace) -> None:
    """Dead-lettering without a reason works and leaves reason and description empty."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        r.dead_letter_message(_one(r))
    with ns.get_queue_receiver("q", sub_queue="deadletter") as dlq:
        m = _one(dlq)
    assert m.dead_letter_reason is None
    assert m.dead_letter_error_description is None


def test_dlq_supports_abandon_and_peek(ns: Namespace) -> None:
    """The DLQ supports the same calls: abandon makes the message available again, peek browses it."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        r.dead_letter_message(_one(r), reason="r")
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert [m.dead_letter_reason for m in peek_all(dlq)] == ["r"]
        m1 = _one(dlq)
        dlq.abandon_message(m1)
        m2 = _one(dlq)
        assert m2.sequence_number == m1.sequence_number
        assert m2.lock_token != m1.lock_token


def test_a_receiver_settles_only_messages_of_its_own_sub_queue(ns: Namespace) -> None:
    """The dead-letter sub-queue is an entity of its own: a message settled through the other sub-queue's receiver
    raises MessageLockLostError and nothing changes, either way."""
    ns.create_queue("q")
    _send(ns, [Message("dead"), Message("live")])
    with ns.get_queue_receiver("q") as main, ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        main.dead_letter_message(_one(main), reason="r")
        dead, live = _one(dlq), _one(main)
        for receiver, m in ((main, dead), (dlq, live)):
            for settle in (receiver.complete_message, receiver.dead_letter_message, receiver.renew_message_lock):
                with pytest.raises(MessageLockLostError):
                    settle(m)
        assert _counts(ns) == (1, 0, 1, 0, 2)
        dlq.complete_message(dead)  # each still holds its own lock
        main.complete_message(live)
    assert _counts(ns) == (0, 0, 0, 0, 0)


def test_dlq_ignores_ttl(ns: Namespace) -> None:
    """A dead-lettered message does not expire from the DLQ even after its time_to_live."""
    ns.create_queue("q")
    _send(ns, [Message("x", time_to_live=timedelta(seconds=3))])
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        r.dead_letter_message(m, reason="keep")
    assert m.expires_at_utc is not None
    sleep_past(m.expires_at_utc)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        dead = _one(dlq)
    assert dead.dead_letter_reason == "keep"
    assert dead.expires_at_utc is not None and dead.expires_at_utc < datetime.now(UTC)


def test_dlq_ignores_max_delivery_count(ns: Namespace) -> None:
    """Dead-lettered messages can be received from the DLQ more often than max_delivery_count."""
    ns.create_queue("q", max_delivery_count=1)
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        r.dead_letter_message(_one(r))
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        for _ in range(3):
            dlq.abandon_message(_one(dlq))
        assert str(_one(dlq)) == "x"


def test_renew_message_lock_extends_the_lock(ns: Namespace) -> None:
    """renew_message_lock extends the lock by lock_duration: the message stays locked past its first expiry.

    Renewed 3 s into a 5 s lock: after the first expiry, the receive and the complete have about 3 s of the renewed one."""
    ns.create_queue("q", lock_duration=timedelta(seconds=5))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r, ns.get_queue_receiver("q") as other:
        m = _one(r)
        first = m.locked_until_utc
        assert first is not None
        time.sleep(3.0)
        before = datetime.now(UTC)
        until = r.renew_message_lock(m)
        assert until >= before + timedelta(seconds=5)
        assert until > first
        assert m.locked_until_utc == until
        sleep_past(first)  # past the first expiry, within the renewed lock
        assert other.receive_messages(max_message_count=1) == []
        r.complete_message(m)
    assert _counts(ns)[4] == 0


# ---- lost locks ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["complete", "abandon", "defer", "dead_letter", "renew"])
def test_settling_with_an_expired_lock_fails_and_changes_nothing(ns: Namespace, op: str) -> None:
    """Every settle call with an expired lock raises MessageLockLostError and leaves the message as it was."""
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        assert m.locked_until_utc is not None
        sleep_past(m.locked_until_utc)
        with pytest.raises(MessageLockLostError):
            _settle(r, m, op)
        assert _counts(ns) == (1, 0, 0, 0, 1)
        again = _one(r)
    assert again.sequence_number == m.sequence_number
    assert again.delivery_count == 1
    assert again.state == "active"


@pytest.mark.parametrize("op", ["complete", "abandon", "defer", "dead_letter", "renew"])
def test_settling_with_a_superseded_lock_fails_and_changes_nothing(ns: Namespace, op: str) -> None:
    """A token replaced by a later delivery raises MessageLockLostError; the current holder's lock is untouched."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as first, ns.get_queue_receiver("q") as second:
        old = _one(first)
        first.abandon_message(old)
        current = _one(second)
        assert current.lock_token != old.lock_token
        with pytest.raises(MessageLockLostError):
            _settle(first, old, op)
        assert _counts(ns) == (1, 0, 0, 0, 1)
        assert first.receive_messages(max_message_count=1) == [], "the current lock must still hold"
        second.complete_message(current)
    assert _counts(ns) == (0, 0, 0, 0, 0)


def test_lock_taken_over_after_expiry_belongs_to_the_new_holder(ns: Namespace) -> None:
    """After a lock expires and another receiver gets the message, the old holder cannot settle it; the new one can."""
    ns.create_queue("q", lock_duration=timedelta(seconds=2))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as slow, ns.get_queue_receiver("q") as fast:
        old = _one(slow)
        assert old.locked_until_utc is not None
        sleep_past(old.locked_until_utc)
        current = _one(fast)
        with pytest.raises(MessageLockLostError):
            slow.complete_message(old)
        with pytest.raises(MessageLockLostError):
            slow.renew_message_lock(old)
        fast.complete_message(current)
    assert _counts(ns) == (0, 0, 0, 0, 0)


def _settle(r: Receiver, m: ReceivedMessage, op: str) -> None:
    if op == "complete":
        r.complete_message(m)
    elif op == "abandon":
        r.abandon_message(m)
    elif op == "defer":
        r.defer_message(m)
    elif op == "dead_letter":
        r.dead_letter_message(m, reason="r")
    else:
        r.renew_message_lock(m)


def test_settling_twice_fails(ns: Namespace) -> None:
    """After complete, the token is no longer a lock: completing again raises MessageLockLostError."""
    ns.create_queue("q")
    _send(ns, [Message("x"), Message("y")])
    with ns.get_queue_receiver("q") as r:
        a, b = drain(r, 2)
        r.complete_message(a)
        with pytest.raises(MessageLockLostError):
            r.complete_message(a)
        r.abandon_message(b)
        with pytest.raises(MessageLockLostError):
            r.complete_message(b)
    assert _counts(ns)[4] == 1


def test_max_delivery_count_dead_letters(ns: Namespace) -> None:
    """A delivery that would exceed max_delivery_count dead-letters the message with MaxDeliveryCountExceeded."""
    ns.create_queue("q", max_delivery_count=2)
    _send(ns, [Message("poison", message_id="p")])
    with ns.get_queue_receiver("q") as r:
        for expected in (0, 1):
            m = _one(r)
            assert m.delivery_count == expected
            r.abandon_message(m)
        assert r.receive_messages(max_message_count=1, max_wait_time=0.3) == []
    assert _counts(ns) == (0, 0, 1, 0, 1)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        m = _one(dlq)
    assert m.message_id == "p"
    assert m.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert m.dead_letter_source == "q"


def test_max_delivery_count_counts_expired_locks(ns: Namespace) -> None:
    """Deliveries whose locks expired count too: after max_delivery_count of them the message is dead-lettered."""
    ns.create_queue("q", max_delivery_count=1, lock_duration=timedelta(seconds=1))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        assert m.locked_until_utc is not None
        sleep_past(m.locked_until_utc)
        assert r.receive_messages(max_message_count=1, max_wait_time=0.3) == []
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert _one(dlq).dead_letter_reason == "MaxDeliveryCountExceeded"


def test_a_deferred_message_dead_lettered_by_its_delivery_count_is_an_active_dead_letter(ns: Namespace) -> None:
    """Over max_delivery_count through receive_deferred_messages, the dead letter is active in the DLQ and receivable."""
    ns.create_queue("q", enable_partitioning=False, max_delivery_count=2)
    (seq,) = _send(ns, [Message("x", message_id="d")])
    with ns.get_queue_receiver("q") as r:
        r.defer_message(_one(r))
        (m,) = r.receive_deferred_messages([seq])
        r.abandon_message(m)
        assert r.receive_deferred_messages([seq]) == []  # a third delivery: dead-lettered instead
    assert _counts(ns) == (0, 0, 1, 0, 1)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (peeked,) = dlq.peek_messages(5)
        m = _one(dlq)
    assert (peeked.state, m.message_id, m.dead_letter_reason) == ("active", "d", "MaxDeliveryCountExceeded")


# ---- batch settlement ------------------------------------------------------------------------


def test_complete_messages_settles_a_batch_across_partitions(ns: Namespace) -> None:
    """complete_messages completes every message of a batch spanning partitions."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{p}", partition_key=key_for_partition(p, "b")) for p in range(0, 16, 2)])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 8)
        assert len({m.partition_id for m in got}) == 8
        r.complete_messages(got)
        assert r.receive_messages(max_message_count=10, max_wait_time=0.3) == []
    assert _counts(ns)[4] == 0


def test_abandon_messages_releases_a_batch(ns: Namespace) -> None:
    """abandon_messages makes every message available again with delivery_count + 1."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}", partition_key=f"k{i}") for i in range(6)])
    with ns.get_queue_receiver("q") as r:
        first = drain(r, 6)
        r.abandon_messages(first)
        again = drain(r, 6)
    assert sorted(m.sequence_number for m in again) == sorted(m.sequence_number for m in first)
    assert {m.delivery_count for m in again} == {1}


def test_complete_messages_with_a_lost_lock_completes_the_rest(ns: Namespace) -> None:
    """complete_messages completes the messages whose lock holds and raises MessageLockLostError for the lost one."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
        r.abandon_message(got[1])  # its token is no longer a lock
        with pytest.raises(MessageLockLostError):
            r.complete_messages(got)
        left = drain_all(r)
    assert [str(m) for m in left] == ["m1"]


# ---- invalid settlements ---------------------------------------------------------------------


def test_settling_a_peeked_message_is_invalid(ns: Namespace) -> None:
    """A peeked message has no lock: settling it raises InvalidOperationError, even while another receiver holds it."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as holder, ns.get_queue_receiver("q") as browser:
        held = _one(holder)
        (peeked,) = peek_all(browser)
        for op in ("complete", "abandon", "defer", "dead_letter", "renew"):
            with pytest.raises(InvalidOperationError):
                _settle(browser, peeked, op)
        holder.complete_message(held)
    assert _counts(ns)[4] == 0


def test_settling_in_receive_and_delete_mode_is_invalid(ns: Namespace) -> None:
    """Messages received in RECEIVE_AND_DELETE mode are already settled: settle calls raise InvalidOperationError."""
    ns.create_queue("q")
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        m = _one(r)
        for op in ("complete", "abandon", "defer", "dead_letter", "renew"):
            with pytest.raises(InvalidOperationError):
                _settle(r, m, op)


def test_settle_on_an_unavailable_partition_fails_and_keeps_the_lock(ns: Namespace) -> None:
    """Settling a message of an unavailable partition raises PartitionUnavailableError; after recovery it works."""
    ns.create_queue("q")
    _send(ns, [Message("x", partition_key=key_for_partition(8, "s"))])
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        ns.fault_injector("q").fail(8, ("read", "write"))
        with pytest.raises(PartitionUnavailableError):
            r.complete_message(m)
        ns.fault_injector("q").heal(8)
        r.complete_message(m)
    assert _counts(ns)[4] == 0


# ---- expiry and deferral ---------------------------------------------------------------------


def test_deferred_message_does_not_expire_into_the_dlq(ns: Namespace) -> None:
    """A deferred message past its TTL is not moved to the dead-letter sub-queue."""
    ns.create_queue("q", dead_lettering_on_message_expiration=True, enable_partitioning=False)
    (seq,) = _send(ns, [Message("d", time_to_live=timedelta(seconds=3))])
    _send(ns, [Message("trigger")])
    with ns.get_queue_receiver("q") as r:
        first = _one(r)
        assert first.sequence_number == seq
        r.defer_message(first)
        assert first.expires_at_utc is not None
        sleep_past(first.expires_at_utc)
        assert [str(m) for m in drain_all(r)] == ["trigger"]
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert peek_all(dlq) == []
        assert dlq.receive_messages(max_message_count=5, max_wait_time=0.2) == []
    assert ns.get_queue_runtime_properties("q").deferred_message_count == 1


def test_expired_locked_message_expires_at_next_receive(ns: Namespace) -> None:
    """A message whose lock lapsed after its TTL passed is not delivered again; it is dead-lettered if configured."""
    ns.create_queue("q", lock_duration=timedelta(seconds=3), dead_lettering_on_message_expiration=True)
    _send(ns, [Message("x", time_to_live=timedelta(seconds=3))])
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        assert m.locked_until_utc is not None and m.expires_at_utc is not None
        sleep_past(max(m.locked_until_utc, m.expires_at_utc))
        assert r.receive_messages(max_message_count=1, max_wait_time=0.3) == []
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert _one(dlq).dead_letter_reason == "TTLExpiredException"


@pytest.mark.parametrize("status", [EntityStatus.RECEIVE_DISABLED, EntityStatus.DISABLED])
def test_receive_deferred_is_refused_while_receives_are_disabled(ns: Namespace, status: EntityStatus) -> None:
    """receive_deferred_messages is a receive: a Disabled or ReceiveDisabled queue refuses it and keeps the message."""
    ns.create_queue("q")
    (seq,) = _send(ns, [Message("d")])
    with ns.get_queue_receiver("q") as r:
        r.defer_message(_one(r))
    ns.update_queue(ns.get_queue("q"), status=status)
    with (
        ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as rd,
        pytest.raises(MessagingEntityDisabledError),
    ):
        rd.receive_deferred_messages([seq])
    assert _counts(ns) == (0, 1, 0, 0, 1)


def test_receive_deferred_in_receive_and_delete_mode_removes_it(ns: Namespace) -> None:
    """receive_deferred_messages in RECEIVE_AND_DELETE mode delivers the deferred message and removes it."""
    ns.create_queue("q")
    (seq,) = _send(ns, [Message("d")])
    with ns.get_queue_receiver("q") as r:
        r.defer_message(_one(r))
    with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as rd:
        (m,) = rd.receive_deferred_messages([seq])
    assert str(m) == "d"
    assert _counts(ns) == (0, 0, 0, 0, 0)
