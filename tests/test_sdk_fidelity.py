"""azure-servicebus SDK fidelity: code ported with only the import swap behaves as the SDK documents (one test per item).

Each test follows the SDK's documented behaviour (its docstrings, samples and public live tests):
`ServiceBusSender`, `ServiceBusReceiver`, `ServiceBusSession`, `AutoLockRenewer`,
`ServiceBusAdministrationClient`.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sparkqueue import AutoLockRenewer, EntityStatus, Message, Namespace, SqlRuleFilter, SubQueue
from sparkqueue.errors import (
    AutoLockRenewFailed,
    EntityNotFoundError,
    MessageAlreadySettled,
    MessageNotFoundError,
    MessageSizeExceededError,
    MessagingEntityDisabledError,
)
from sparkqueue.model.deadlines import call_timeout, effective
from sparkqueue.model.properties import QueueProperties, RuleProperties
from tests.procs import drain, peek_all, sleep_past


def _one(r: Any) -> Any:
    (m,) = drain(r, 1)
    return m


# 1 ---------------------------------------------------------------------------------------------


def test_01_received_message_can_be_sent_and_scheduled_again(ns: Namespace) -> None:
    """send_messages(received) and schedule_messages(received, t) resend its body and properties."""
    ns.create_queue("q")
    ns.create_queue("other")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("hello", message_id="m1", subject="s", application_properties={"k": 1}, correlation_id="c"))
    with ns.get_queue_receiver("q") as r:
        got = _one(r)
        with ns.get_queue_sender("other") as s2:
            s2.send_messages(got)
            (seq,) = s2.schedule_messages(got, datetime.now(UTC) + timedelta(hours=1))
        r.complete_message(got)
    with ns.get_queue_receiver("other") as r2:
        back = _one(r2)
        assert (str(back), back.message_id, back.subject, back.correlation_id) == ("hello", "m1", "s", "c")
        assert back.application_properties == {"k": 1}
        (scheduled,) = [m for m in peek_all(r2) if m.sequence_number == seq]
        assert scheduled.state == "scheduled"


# 2 ---------------------------------------------------------------------------------------------


def test_02_auto_lock_renewer_keeps_message_and_session_locks(ns: Namespace) -> None:
    """Registered messages (and the receiver's auto_lock_renewer=) keep their locks past lock_duration; close() stops.

    4 s locks: the renewer looks every 0.5 s, so a loaded machine keeps over 3 s of slack."""
    ns.create_queue("q", lock_duration=timedelta(seconds=4))
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a"), Message("b")])
    with AutoLockRenewer(max_lock_renewal_duration=30) as renewer:
        with ns.get_queue_receiver("q") as r:
            m = _one(r)
            renewer.register(r, m)
            sleep_past(m.locked_until_utc + timedelta(seconds=1))
            r.complete_message(m)  # the lock was renewed: still valid
        with ns.get_queue_receiver("q", auto_lock_renewer=renewer) as r:
            m2 = _one(r)
            first_until = m2.locked_until_utc
            sleep_past(first_until + timedelta(seconds=1))
            r.complete_message(m2)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0

    ns.create_queue("sq", requires_session=True, lock_duration=timedelta(seconds=4))
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("x", session_id="s1"))
    renewer = AutoLockRenewer()
    with ns.get_queue_receiver("sq", session_id="s1", auto_lock_renewer=renewer) as r:
        assert r.session is not None
        until = r.session.locked_until_utc
        sleep_past(until + timedelta(seconds=1))
        r.complete_message(_one(r))  # the session lock was renewed too
        assert r.session.locked_until_utc > until
    renewer.close()
    with pytest.raises(ValueError):
        renewer.register(r, r.session)


def test_02_a_session_message_is_refused_by_the_renewer_as_the_sdk_refuses_it(ns: Namespace) -> None:
    """A session's messages hold no lock of their own (their session's covers them): the SDK's register raises
    ValueError for one; sparkqueue took it and failed each renewal. The session itself is what to register."""
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("x", session_id="s1"))
    with AutoLockRenewer() as renewer, ns.get_queue_receiver("sq", session_id="s1") as r:
        m = _one(r)
        with pytest.raises(ValueError, match=r"register receiver\.session"):
            renewer.register(r, m)
        renewer.register(r, r.session)
        r.complete_message(m)


def test_02_auto_lock_renewer_reports_a_lost_lock(ns: Namespace) -> None:
    """on_lock_renew_failure(renewable, error) is called when renewal fails; the error is kept on the message."""
    ns.create_queue("q", lock_duration=timedelta(seconds=2))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("a"))
    failures: list[tuple[Any, BaseException | None]] = []
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        r.abandon_message(_copy(m))  # another handle settles it: m's lock is gone
        renewer = AutoLockRenewer(on_lock_renew_failure=lambda msg, err: failures.append((msg, err)))
        renewer.register(r, m)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.1)
        renewer.close()
    (msg, err), *_ = failures
    assert msg is m and isinstance(err, AutoLockRenewFailed) and m.auto_renew_error is err


def test_02_a_message_settled_while_its_renewal_batch_is_picked_stops_only_its_own_renewal(ns: Namespace) -> None:
    """Messages of two receivers under one renewer, with 4 s locks (under the renewer's 10 s period, so every pass renews
    all of them); one receiver's messages are completed one by one. A renewal batch that held a message completed after
    the pass picked it was refused whole (MessageAlreadySettled), and every other message in it stopped being renewed:
    67-105 of 200 later completes lost their locks. Only the settled message's registration ends now."""
    failures: list[tuple[Any, BaseException | None]] = []
    for q in ("q1", "q2"):
        ns.create_queue(q, lock_duration=timedelta(seconds=4), enable_partitioning=False)
        ns.get_queue_sender(q).send_messages([Message(f"{q}-{i}") for i in range(200)])
    renewer = AutoLockRenewer(max_lock_renewal_duration=600, on_lock_renew_failure=lambda m, e: failures.append((m, e)))
    with ns.get_queue_receiver("q1") as r1, ns.get_queue_receiver("q2") as r2, renewer:
        a = r1.receive_messages(max_message_count=200, max_wait_time=2)
        b = r2.receive_messages(max_message_count=200, max_wait_time=2)
        assert len(a) == len(b) == 200
        for m in a:
            renewer.register(r1, m)
        for m in b:
            renewer.register(r2, m)
        for m in b:  # completed one by one while both receivers' locks are renewed
            r2.complete_message(m)
            time.sleep(0.01)
        time.sleep(4.5)  # past a lock duration: q1's locks live only if they were renewed
        r1.complete_messages(a)
    assert failures == []


@pytest.mark.parametrize("partitioned", [True, False])
def test_02_auto_lock_renewer_keeps_a_whole_receive_batch_and_reports_nothing_settled(ns: Namespace, partitioned: bool) -> None:
    """A batch of 100 messages from one receive, renewed past their lock, then completed while renewals run.

    Each renewal was its own commit on the batch's shared file, on a thread per message: the commits
    conflicted, retried past the locks' expiry, and 80-87 of 100 locks were lost. Messages completed while
    a renewal ran were also reported to the failure callback. One worker renews a receiver's due locks together.
    """
    import threading

    ns.create_queue("q", lock_duration=timedelta(seconds=5), enable_partitioning=partitioned)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(100)])
    failures: list[tuple[Any, BaseException | None]] = []
    renewer = AutoLockRenewer(on_lock_renew_failure=lambda msg, err: failures.append((msg, err)))
    with renewer, ns.get_queue_receiver("q", auto_lock_renewer=renewer) as r:
        got = drain(r, 100)
        workers = [t for t in threading.enumerate() if t.name == "sparkqueue-lock-renewer"]
        assert len(workers) == 1  # one worker, not a thread per message
        sleep_past(max(m.locked_until_utc for m in got) + timedelta(seconds=3))
        r.complete_messages(got)  # every lock still held: MessageLockLostError otherwise
        time.sleep(1.5)  # renewals that were in flight end
    assert failures == []
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_02_a_closed_auto_lock_renewer_is_refused_before_the_receive_takes_anything(ns: Namespace) -> None:
    """The receive used to lock and count its messages, then raise: they stayed locked and nobody saw them."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(5)])
    renewer = AutoLockRenewer()
    renewer.close()
    with ns.get_queue_receiver("q", auto_lock_renewer=renewer) as r:
        with pytest.raises(ValueError, match="AutoLockRenewer is closed"):
            r.receive_messages(5)
        with pytest.raises(ValueError, match="AutoLockRenewer is closed"):
            r.receive_deferred_messages([1])
    with ns.get_queue_receiver("q") as other:
        got = drain(other, 5)
    assert len(got) == 5 and {m.delivery_count for m in got} == {0}


def _copy(m: Any) -> Any:
    import dataclasses

    return dataclasses.replace(m)


# 3 ---------------------------------------------------------------------------------------------


def test_03_application_properties_answer_bytes_and_str_keys(ns: Namespace) -> None:
    """props[b"key"] and props["key"] both find a received message's property."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", application_properties={"key": "v", "n": 2}))
    with ns.get_queue_receiver("q") as r:
        props = _one(r).application_properties
    assert props[b"key"] == props["key"] == "v" and props.get(b"n") == 2 and b"key" in props


# 4 ---------------------------------------------------------------------------------------------


def test_04_dead_letter_reason_is_in_the_application_properties(ns: Namespace) -> None:
    """A dead letter carries DeadLetterReason and DeadLetterErrorDescription as properties and as fields."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        r.dead_letter_message(_one(r), reason="Poison", error_description="cannot parse")
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        m = _one(dlq)
    assert (m.dead_letter_reason, m.dead_letter_error_description) == ("Poison", "cannot parse")
    assert m.application_properties[b"DeadLetterReason"] == "Poison"
    assert m.application_properties["DeadLetterErrorDescription"] == "cannot parse"


def test_04_dead_letter_annotations_overwrite_user_properties_of_their_names_and_only_dead_letters_lose_them(
    ns: Namespace,
) -> None:
    """A sender's own DeadLetterReason property hid the real reason in application_properties, and resending a
    message never dead-lettered dropped it. Service Bus overwrites the property on dead-lettering, and only then."""
    ns.create_queue("q")
    ns.create_queue("copies")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", application_properties={"DeadLetterReason": "mine", "k": 1}))
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        ns.get_queue_sender("copies").send_messages(m)  # resending a received message (SDK pattern)
        r.dead_letter_message(m, reason="Poison")
    with ns.get_queue_receiver("copies") as r:
        assert dict(_one(r).application_properties) == {"DeadLetterReason": "mine", "k": 1}
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        dead = _one(dlq)
        assert dead.dead_letter_reason == dead.application_properties["DeadLetterReason"] == "Poison"
        ns.get_queue_sender("copies").send_messages(dead)  # a resubmitted dead letter leaves its annotations behind
    with ns.get_queue_receiver("copies") as r:
        assert dict(_one(r).application_properties) == {"k": 1}


# 5 ---------------------------------------------------------------------------------------------


def test_05_receiver_is_an_iterator(ns: Namespace) -> None:
    """next(receiver) gives the next message; iteration ends when none arrives within max_wait_time."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a"), Message("b")])
    with ns.get_queue_receiver("q", max_wait_time=1) as r:
        first = next(r)
        rest = list(r)
        assert iter(r) is r
        with pytest.raises(StopIteration):
            next(r)
    assert sorted([str(first), *map(str, rest)]) == ["a", "b"]


# 6 ---------------------------------------------------------------------------------------------


def test_06_per_call_timeout_is_accepted_and_bounds_the_call(ns: Namespace) -> None:
    """timeout= is accepted by receive, peek, deferral, lock renewal, session state and management calls."""
    ns.create_queue("q", timeout=30)
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("a"), timeout=10)
    with ns.get_queue_receiver("q") as r:
        assert len(r.peek_messages(5, timeout=5)) == 1
        m = r.receive_messages(1, max_wait_time=2, timeout=5)[0]
        r.renew_message_lock(m, timeout=5)
        r.defer_message(m)
        (d,) = r.receive_deferred_messages([m.sequence_number], timeout=5)
        r.complete_message(d)
        for bad in (0, -1, float("nan"), float("inf"), "5"):
            with pytest.raises((ValueError, TypeError)):
                r.peek_messages(1, timeout=bad)
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("x", session_id="s"))
    with ns.get_queue_receiver("sq", session_id="s") as r:
        assert r.session is not None
        r.session.set_state(b"st", timeout=5)
        assert r.session.get_state(timeout=5) == b"st"
        r.session.renew_lock(timeout=5)
    assert ns.get_queue("q", timeout=5).name == "q"
    assert [q.name for q in ns.list_queues(timeout=5)] == ["q", "sq"]
    # The bound: inside a call with timeout=t every operation's deadline is at most t seconds away.
    with call_timeout(0.5):
        assert effective(60.0) == 0.5
    assert effective(60.0) == 60.0


# 7 ---------------------------------------------------------------------------------------------


def test_07_ids_accept_uuids_and_read_back_as_str(ns: Namespace) -> None:
    """message_id, correlation_id and session_id accept a uuid.UUID (as the SDK) and are received as str."""
    ns.create_queue("q")
    ns.create_queue("sq", requires_session=True)
    mid, cid, sid = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", message_id=mid, correlation_id=cid))
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("y", session_id=sid))
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
    assert (m.message_id, m.correlation_id) == (str(mid), str(cid))
    with ns.get_queue_receiver("sq", session_id=str(sid)) as r:
        assert _one(r).session_id == str(sid)


# 8 ---------------------------------------------------------------------------------------------


def test_08_receive_deferred_of_a_message_not_deferred_raises_message_not_found(ns: Namespace) -> None:
    """Completed, never-deferred and unknown sequence numbers raise MessageNotFoundError; nothing is received."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        active, done, deferred = s.send_messages([Message("a"), Message("b"), Message("c")])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 3):
            if m.sequence_number == done:
                r.complete_message(m)
            elif m.sequence_number == deferred:
                r.defer_message(m)
            else:
                r.abandon_message(m)
        for bad in ([active], [done], [deferred + 10_000], [deferred, done]):
            with pytest.raises(MessageNotFoundError):
                r.receive_deferred_messages(bad)
        (d,) = r.receive_deferred_messages([deferred])  # untouched by the failed calls
        assert d.sequence_number == deferred


# 9 ---------------------------------------------------------------------------------------------


def test_09_size_limits_as_service_bus_enforces_them(ns: Namespace) -> None:
    """Over 256 KB (body and properties) raises MessageSizeExceededError; a list must fit one batch; default batch size."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(MessageSizeExceededError):
            s.send_messages(Message(b"x" * 200_000, application_properties={"p": "y" * 70_000}))
        with pytest.raises(MessageSizeExceededError):
            s.send_messages([Message(b"x" * 100_000) for _ in range(3)])
        batch = s.create_message_batch()
        assert batch.max_size_in_bytes == 256 * 1024
        batch.add_message(Message(b"x" * 100_000))
        batch.add_message(Message(b"x" * 100_000))
        with pytest.raises(MessageSizeExceededError):
            batch.add_message(Message(b"x" * 100_000))
        assert len(s.send_messages(batch)) == 2
    assert ns.get_queue_runtime_properties("q").total_message_count == 2


# 10 --------------------------------------------------------------------------------------------


def test_10_send_accepts_dicts_and_a_none_body(ns: Namespace) -> None:
    """send_messages({"body": ...}) and a list of dicts work; Message(body=None) is allowed."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages({"body": "one", "message_id": "d1"})
        s.send_messages([{"body": b"two", "subject": "s"}, {"body": None}])
        s.send_messages(Message(body=None))
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 4)
    assert sorted(m.body for m in got) == [b"", b"", b"one", b"two"]


# 11 --------------------------------------------------------------------------------------------


def test_11_closed_sender_and_receiver_raise_value_error(ns: Namespace) -> None:
    """Using a closed handler raises ValueError; it is not silently reopened."""
    ns.create_queue("q")
    s = ns.get_queue_sender("q")
    s.close()
    with pytest.raises(ValueError):
        s.send_messages(Message("x"))
    with pytest.raises(ValueError):
        s.create_message_batch()
    r = ns.get_queue_receiver("q")
    r.close()
    for call in (lambda: r.receive_messages(), lambda: r.peek_messages(), lambda: next(r)):
        with pytest.raises(ValueError):
            call()
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


# 12 --------------------------------------------------------------------------------------------


def test_12_max_wait_time_zero_and_partition_key_mismatch_raise_value_error(ns: Namespace) -> None:
    """max_wait_time 0 or negative raises ValueError; a partition_key differing from session_id fails at assignment."""
    ns.create_queue("q")
    for bad in (0, -1, 0.0):
        with pytest.raises(ValueError):
            ns.get_queue_receiver("q", max_wait_time=bad)
        with ns.get_queue_receiver("q") as r, pytest.raises(ValueError):
            r.receive_messages(max_wait_time=bad)
    m = Message("x", session_id="s1")
    m.partition_key = "s1"
    with pytest.raises(ValueError):
        m.partition_key = "other"
    assert m.partition_key == "s1"


# 13 --------------------------------------------------------------------------------------------


def test_13_management_settings_status_and_runtime_properties(ns: Namespace) -> None:
    """The SDK's other settings are kept; a disabled entity refuses sends and receives; runtime has status and times."""
    q = ns.create_queue(
        "q",
        auto_delete_on_idle="PT10M",
        enable_batched_operations=False,
        enable_express=True,
        user_metadata="meta",
        lock_duration="PT13S",
        default_message_time_to_live=timedelta(days=10_675_199),
    )
    got = ns.get_queue("q")
    assert (got.auto_delete_on_idle, got.lock_duration, got.default_message_time_to_live) == (
        timedelta(minutes=10),
        timedelta(seconds=13),
        None,  # Service Bus's "infinite" TTL: never expires
    )
    assert (got.enable_batched_operations, got.enable_express, got.user_metadata, got.status) == (False, True, "meta", "Active")
    assert dict(q)["user_metadata"] == "meta" and q["lock_duration"] == timedelta(seconds=13)

    ns.update_queue(got, status=EntityStatus.DISABLED)
    with ns.get_queue_sender("q") as s, pytest.raises(MessagingEntityDisabledError):
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r, pytest.raises(MessagingEntityDisabledError):
        r.receive_messages()
    ns.update_queue(dict(ns.get_queue("q")), status=EntityStatus.SEND_DISABLED)
    ns.update_queue(ns.get_queue("q"), status="Active")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))

    rt = ns.get_queue_runtime_properties("q")
    assert rt.status == EntityStatus.ACTIVE and rt.total_message_count == 1
    assert rt.created_at_utc is not None and rt.updated_at_utc is not None and rt.accessed_at_utc is not None
    assert [x.name for x in ns.list_queues_runtime_properties()] == ["q"]

    ns.create_topic("t", support_ordering=False)
    ns.create_subscription("t", "s", dead_lettering_on_filter_evaluation_exceptions=False)
    ns.create_rule("t", "s", "r", filter=SqlRuleFilter("a = 1"))
    assert [x.name for x in ns.list_topics_runtime_properties()] == ["t"]
    assert [x.name for x in ns.list_subscriptions_runtime_properties("t")] == ["s"]
    rule = ns.get_rule("t", "s", "r")
    ns.update_rule("t", "s", rule, filter=SqlRuleFilter("a = 2"))
    assert ns.get_rule("t", "s", "r").filter.sql_expression == "a = 2"
    ns.update_rule("t", "s", RuleProperties("r", SqlRuleFilter("a = 3")))
    assert ns.get_rule("t", "s", "r").filter.sql_expression == "a = 3"
    with pytest.raises(EntityNotFoundError):
        ns.update_rule("t", "s", RuleProperties("nope", SqlRuleFilter("a = 3")))

    with pytest.raises(ValueError):
        ns.delete_queue("")
    with pytest.raises(TypeError):
        ns.delete_queue(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ns.update_queue(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ns.update_queue(QueueProperties("q"), lock_duration="not a duration")
    assert ns.get_queue("q").lock_duration == timedelta(seconds=13)


# 14 --------------------------------------------------------------------------------------------


def test_14_delivery_count_counts_earlier_deliveries(ns: Namespace) -> None:
    """delivery_count is 0 on the first delivery; max_delivery_count still bounds the number of deliveries."""
    ns.create_queue("q", max_delivery_count=3)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    counts = []
    with ns.get_queue_receiver("q") as r:
        while got := r.receive_messages(max_wait_time=0.5):
            counts.append(got[0].delivery_count)
            r.abandon_message(got[0])
    assert counts == [0, 1, 2]  # delivered exactly max_delivery_count times
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        dead = _one(dlq)
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"


def test_settling_a_settled_message_again_raises_message_already_settled(ns: Namespace) -> None:
    """As in the SDK, settling (or renewing) a message this handle already settled raises MessageAlreadySettled."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        r.complete_message(m)
        for settle in (r.complete_message, r.abandon_message, r.renew_message_lock):
            with pytest.raises(MessageAlreadySettled):
                settle(m)


def test_14_peek_counts_only_deliveries_that_ended(ns: Namespace) -> None:
    """As the SDK documents, delivery_count rises when a lock expires or the message is abandoned, not while it is locked."""
    ns.create_queue("q", lock_duration=timedelta(seconds=2))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        m = _one(r)
        assert [p.delivery_count for p in r.peek_messages(1, sequence_number=0)] == [0]  # locked: still 0
        assert [p.delivery_count for p in r.peek_messages(1, 0)] == [0]  # by position too (docs/semantics.md §5)
        sleep_past(m.locked_until_utc)
        assert [p.delivery_count for p in r.peek_messages(1, sequence_number=0)] == [1]  # the lock expired
        again = _one(r)
        r.abandon_message(again)
        assert again.delivery_count == 1
        assert [p.delivery_count for p in r.peek_messages(1, sequence_number=0)] == [2]


def test_15_received_messages_are_hashable(ns: Namespace) -> None:
    """As the SDK's, received messages go in sets and dict keys (a handler's "seen" set), also after a settle."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("a"), Message("b")])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 2)
        seen = {m: str(m) for m in got}
        r.complete_message(got[0])  # a settle changes no field the hash reads
        assert got[0] in seen and len(set(got)) == 2


def test_entity_properties_report_their_availability_and_updates_take_the_sdk_dict(ns: Namespace) -> None:
    """The SDK's property objects carry availability_status; a dict of them (as the SDK's dict form) updates as it is."""
    ns.create_queue("q")
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    for props in (ns.get_queue("q"), ns.get_topic("t"), ns.get_subscription("t", "s")):
        assert props.availability_status == "Available"
    assert dict(ns.get_queue("q"))["availability_status"] == ns.get_queue("q")["availability_status"] == "Available"
    sdk_dict = {**dict(ns.get_queue("q")), "max_delivery_count": 3}
    ns.update_queue(sdk_dict)
    assert ns.get_queue("q").max_delivery_count == 3
    with pytest.raises(AttributeError):
        ns.get_queue("q").availability_status = "Limited"  # type: ignore[misc]  # describes the entity: not a setting


def test_renew_message_locks_renews_many_at_once_and_reports_lost_ones(ns: Namespace) -> None:
    """The batch renewal AutoLockRenewer uses (sparkqueue extension): one commit per partition, lost locks reported."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
        before = [m.locked_until_utc for m in got]
        r.complete_message(_copy(got[0]))  # another handle settles the first: its lock is gone
        assert r.renew_message_locks(got) == [False, True, True]
        assert got[0].locked_until_utc == before[0] and all(
            m.locked_until_utc > b for m, b in zip(got[1:], before[1:], strict=True)
        )
        r.complete_messages(got[1:])
