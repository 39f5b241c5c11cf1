"""Auto-forwarding (docs/semantics.md §9): chains, hop limit, partition keys, subscriptions and topics, dead letters, failures."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from procs import drain, partition_for, peek_all

from sparkqueue import Message, Namespace, SqlRuleAction, SqlRuleFilter, SubQueue
from sparkqueue.constants import EntityStatus
from sparkqueue.errors import EntityNotFoundError, InvalidOperationError

HOP_LIMIT = "MaxTransferHopCountExceeded"
MISSING = "ForwardingDestinationNotFound"


def queue_ids(ns: Namespace, queue: str, *, dead_letter: bool = False) -> Counter[str]:
    """message_id -> copies in a queue (or its dead-letter sub-queue)."""
    with ns.get_queue_receiver(queue, sub_queue=SubQueue.DEAD_LETTER if dead_letter else None) as r:
        return Counter(m.message_id for m in peek_all(r))


def sub_ids(ns: Namespace, topic: str, sub: str, *, dead_letter: bool = False) -> Counter[str]:
    """message_id -> copies in a subscription (or its dead-letter sub-queue)."""
    with ns.get_subscription_receiver(topic, sub, sub_queue=SubQueue.DEAD_LETTER if dead_letter else None) as r:
        return Counter(m.message_id for m in peek_all(r))


def batch(prefix: str, n: int) -> list[Message]:
    """n messages, half with a partition key, half without."""
    return [
        Message(f"{prefix}{i}", message_id=f"{prefix}{i}", partition_key=f"k{i}" if i % 2 else None, subject="s")
        for i in range(n)
    ]


# ---- chains and the hop limit -------------------------------------------------------------------------


@pytest.mark.parametrize("hops", [1, 2, 3, 4])
def test_forwarding_chain(ns: Namespace, hops: int) -> None:
    """A chain of up to 4 forwarding hops delivers every message exactly once at its end."""
    for i in range(hops, -1, -1):
        ns.create_queue(f"q{i}", forward_to=f"q{i + 1}" if i < hops else None, enable_partitioning=i % 2 == 0)
    ns.get_queue_sender("q0").send_messages(batch("m", 6))
    want = Counter({f"m{i}": 1 for i in range(6)})
    assert queue_ids(ns, f"q{hops}") == want
    for i in range(hops):
        assert queue_ids(ns, f"q{i}") == Counter()
        assert queue_ids(ns, f"q{i}", dead_letter=True) == Counter()
    assert ns.get_queue_runtime_properties("q0").total_message_count == 0
    with ns.get_queue_receiver(f"q{hops}") as r:
        got = drain(r, 6)
    assert sorted(m.message_id for m in got) == sorted(want)
    assert all(m.delivery_count == 0 and m.subject == "s" and str(m) == m.message_id for m in got)


def test_fifth_hop_dead_letters_at_fifth_source(ns: Namespace) -> None:
    """A fifth hop is refused: the message is dead-lettered at the fifth source with MaxTransferHopCountExceeded."""
    for i in range(5, -1, -1):
        ns.create_queue(f"q{i}", forward_to=f"q{i + 1}" if i < 5 else None)
    ns.get_queue_sender("q0").send_messages(batch("m", 4))
    want = Counter({f"m{i}": 1 for i in range(4)})
    assert queue_ids(ns, "q4", dead_letter=True) == want
    for i in range(6):
        assert queue_ids(ns, f"q{i}") == Counter(), i
        if i != 4:
            assert queue_ids(ns, f"q{i}", dead_letter=True) == Counter(), i
    assert ns.get_queue_runtime_properties("q4").dead_letter_message_count == 4
    with ns.get_queue_receiver("q4", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        got = drain(dlq, 4)
    assert {m.dead_letter_reason for m in got} == {HOP_LIMIT}
    assert sorted(m.message_id for m in got) == sorted(want)


def test_forwarding_loop_stops_at_hop_limit(ns: Namespace) -> None:
    """A forwarding cycle cannot move a message forever: it ends dead-lettered once, nothing is lost or doubled."""
    ns.create_queue("a")
    ns.create_queue("b", forward_to="a")
    ns.update_queue(ns.get_queue("a"), forward_to="b")  # a destination must exist: the cycle is closed by an update
    ns.get_queue_sender("a").send_messages(batch("m", 3))
    ns.forward_pending_messages()
    everywhere = (
        queue_ids(ns, "a") + queue_ids(ns, "b") + queue_ids(ns, "a", dead_letter=True) + queue_ids(ns, "b", dead_letter=True)
    )
    assert everywhere == Counter({f"m{i}": 1 for i in range(3)})
    # after 4 hops (a->b->a->b->a) the messages sit dead-lettered in a
    assert queue_ids(ns, "a", dead_letter=True) == Counter({f"m{i}": 1 for i in range(3)})


def test_a_send_forwards_through_a_topic_with_many_forwarding_subscriptions(ns: Namespace) -> None:
    """q forwards to topic t, whose 12 subscriptions each forward to dst: the send delivers all 12 copies at once.

    Before, one forward handled at most 10 entities, so 3 subscriptions kept their copies in their main queues
    (unreceivable there: they forward) until forward_pending_messages or maintenance.
    """
    ns.create_queue("dst", enable_partitioning=False)
    ns.create_topic("t", enable_partitioning=False)
    for i in range(12):
        ns.create_subscription("t", f"s{i:02d}", forward_to="dst")
    ns.create_queue("q", enable_partitioning=False, forward_to="t")
    ns.get_queue_sender("q").send_messages(batch("m", 1))
    assert queue_ids(ns, "dst") == Counter({"m0": 12})
    for i in range(12):
        assert ns.get_subscription_runtime_properties("t", f"s{i:02d}").total_message_count == 0


def test_a_queue_cannot_forward_to_itself(ns: Namespace) -> None:
    """As in Service Bus, forward_to naming the queue itself (in any case) is refused at create and update; nothing changes."""
    with pytest.raises(InvalidOperationError, match="itself"):
        ns.create_queue("self", forward_to="self")
    assert [q.name for q in ns.list_queues()] == []
    ns.create_queue("Self")
    props = ns.get_queue("self")
    props.forward_to = "SELF"
    with pytest.raises(InvalidOperationError, match="itself"):
        ns.update_queue(props)
    with pytest.raises(InvalidOperationError, match="itself"):
        ns.update_queue(ns.get_queue("Self"), forward_to="self")
    assert ns.get_queue("Self").forward_to is None
    props.forward_to = None
    props.forward_dead_lettered_messages_to = "Self"  # dead letters back into the queue: allowed, bounded by the hop count
    ns.update_queue(props)
    assert ns.get_queue("Self").forward_dead_lettered_messages_to == "Self"


def test_a_subscription_cannot_forward_to_its_own_topic(ns: Namespace) -> None:
    """Accepted before: each copy fanned out again to every subscription (one message gave a sibling 5 copies).

    Refused at create and update, in any case; its dead letters may still go to the topic.
    """
    ns.create_topic("Orders")
    ns.create_subscription("Orders", "sibling")
    with pytest.raises(InvalidOperationError, match="cannot forward its messages to that topic"):
        ns.create_subscription("Orders", "loop", forward_to="orders")
    assert [s.name for s in ns.list_subscriptions("Orders")] == ["sibling"]
    with pytest.raises(InvalidOperationError, match="cannot forward its messages to that topic"):
        ns.update_subscription("Orders", ns.get_subscription("Orders", "sibling"), forward_to="ORDERS")
    assert ns.get_subscription("Orders", "sibling").forward_to is None
    ns.update_subscription("Orders", ns.get_subscription("Orders", "sibling"), forward_dead_lettered_messages_to="Orders")
    ns.get_topic_sender("Orders").send_messages(batch("m", 1))
    assert ns.get_subscription_runtime_properties("Orders", "sibling").active_message_count == 1


# ---- what cannot travel ---------------------------------------------------------------------------


def _session_setting_topic(ns: Namespace, **sub_settings: object) -> None:
    """A topic whose subscription gives message 'a' (sent with partition key 'k') a session id by a rule action."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "s", **sub_settings)
    ns.create_rule("t", "s", "tag", filter=SqlRuleFilter("sys.MessageId = 'a'"), action=SqlRuleAction("SET sys.SessionId = 'x'"))
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("a", message_id="a", partition_key="k"), Message("b", message_id="b")])


def test_a_copy_an_action_gave_a_session_id_travels_with_it_as_its_partition_key(ns: Namespace) -> None:
    """Such a copy kept partition key 'k' beside session id 'x', which no partition can take: forwarding dead-lettered it
    (ForwardingPartitionKeyConflict). The key now follows the session id (docs/semantics.md §8), and the copy travels.
    (Copies stored with conflicting keys before that are still dead-lettered when forwarded.)"""
    ns.create_queue("dst")
    _session_setting_topic(ns, forward_to="dst")
    ns.get_topic_sender("t").send_messages(Message("c", message_id="c"))
    assert queue_ids(ns, "dst") == Counter({"a": 2, "b": 1, "c": 1})  # $Default's copy of 'a' and the rule's
    with ns.get_queue_receiver("dst") as r:
        moved = sorted((m.session_id or "", m.partition_key or "") for m in peek_all(r) if m.message_id == "a")
    assert moved == [("", "k"), ("x", "x")]
    assert sub_ids(ns, "t", "s") == Counter()
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert peek_all(dlq) == []


def test_dead_letters_an_action_gave_a_session_id_are_forwarded_too(ns: Namespace) -> None:
    """forward_dead_lettered_messages_to moves such a dead letter with the others: its keys agree."""
    ns.create_queue("dst")
    _session_setting_topic(ns, forward_dead_lettered_messages_to="dst")
    with ns.get_subscription_receiver("t", "s") as r:
        for m in drain(r, 3):
            r.dead_letter_message(m, reason="bad")
    assert queue_ids(ns, "dst") == Counter({"a": 2, "b": 1})
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert peek_all(dlq) == []


@pytest.mark.parametrize("status", [EntityStatus.DISABLED, EntityStatus.SEND_DISABLED])
def test_a_disabled_destination_dead_letters_at_the_source(ns: Namespace, status: EntityStatus) -> None:
    """As in Service Bus, a destination that takes no sends gets nothing: the source dead-letters; its dead letters wait."""
    ns.create_queue("dst", status=status)
    ns.create_queue("src", forward_to="dst", forward_dead_lettered_messages_to="dst")
    ns.get_queue_sender("src").send_messages(Message("x", message_id="m"))
    assert ns.get_queue_runtime_properties("dst").total_message_count == 0
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert (m.message_id, m.dead_letter_reason) == ("m", "ForwardingDestinationDisabled")


def test_a_forwarded_copy_takes_the_destination_default_ttl(ns: Namespace) -> None:
    """A copy's TTL is capped by the destination's default_message_time_to_live (a queue's, or a topic's) as a send there."""
    ns.create_queue("dst", default_message_time_to_live=timedelta(seconds=30))
    ns.create_topic("t", default_message_time_to_live=timedelta(seconds=20))
    ns.create_subscription("t", "s")
    ns.create_queue("to-q", forward_to="dst")
    ns.create_queue("to-t", forward_to="t")
    ns.get_queue_sender("to-q").send_messages(Message("q", time_to_live=timedelta(hours=1)))
    ns.get_queue_sender("to-t").send_messages(Message("t"))
    with ns.get_queue_receiver("dst") as r:
        (m,) = peek_all(r)
    with ns.get_subscription_receiver("t", "s") as r:
        (n,) = peek_all(r)
    assert m.time_to_live == timedelta(seconds=30)
    assert m.expires_at_utc == m.enqueued_time_utc + timedelta(seconds=30)
    assert n.time_to_live == timedelta(seconds=20)
    assert n.expires_at_utc == n.enqueued_time_utc + timedelta(seconds=20)


def test_an_expired_message_is_not_forwarded(ns: Namespace) -> None:
    """A message that expired before it could travel expires at the source (dead-lettered there if it says so)."""
    ns.create_queue("dst")
    ns.create_queue("src", dead_lettering_on_message_expiration=True)
    old = Message("old", message_id="old", time_to_live=timedelta(seconds=1))
    ns.get_queue_sender("src").send_messages([old, Message("new")])
    time.sleep(1.2)
    props = ns.get_queue("src")
    props.forward_to = "dst"
    ns.update_queue(props)
    ns.forward_pending_messages()
    assert [m.body for m in peek_all(ns.get_queue_receiver("dst"))] == [b"new"]
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert (m.message_id, m.dead_letter_reason) == ("old", "TTLExpiredException")


def test_messages_a_receive_dead_letters_are_forwarded(ns: Namespace) -> None:
    """Dead letters made by a receive (max delivery count) are forwarded at once, as dead_letter_message's are."""
    ns.create_queue("dst")
    ns.create_queue("src", max_delivery_count=1, forward_dead_lettered_messages_to="dst")
    ns.get_queue_sender("src").send_messages(Message("x", message_id="m"))
    with ns.get_queue_receiver("src") as r:
        (m,) = drain(r, 1)
        r.abandon_message(m)
        assert r.receive_messages(max_wait_time=0.3) == []  # a second delivery would pass the count: dead-lettered
    with ns.get_queue_receiver("dst") as r:
        (m,) = drain(r, 1)
    assert (m.message_id, m.dead_letter_reason) == ("m", "MaxDeliveryCountExceeded")


def test_a_forwarding_entity_refuses_receivers_but_its_dead_letters_stay_receivable(ns: Namespace) -> None:
    """As in Service Bus, nothing receives from an auto-forwarding queue or subscription; peek and the DLQ still work."""
    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")
    ns.create_topic("t")
    ns.create_subscription("t", "s", forward_to="dst", requires_session=True)
    with ns.get_queue_receiver("src") as r, pytest.raises(InvalidOperationError, match="forwards"):
        r.receive_messages(max_wait_time=0.1)
    with pytest.raises(InvalidOperationError, match="forwards"):
        ns.get_subscription_receiver("t", "s", session_id="x")
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert dlq.receive_messages(max_wait_time=0.1) == []
    assert peek_all(ns.get_queue_receiver("src")) == []


def test_an_abandon_forwards_what_a_receiver_held_when_forward_to_was_set(ns: Namespace) -> None:
    """Messages locked before forward_to was set travel when their holder abandons them; nothing is left behind."""
    ns.create_queue("dst")
    ns.create_queue("src", enable_partitioning=False)
    ns.get_queue_sender("src").send_messages([Message("m1", message_id="m1"), Message("m2", message_id="m2")])
    with ns.get_queue_receiver("src") as r:
        (m,) = r.receive_messages(max_wait_time=1)
        props = ns.get_queue("src")
        props.forward_to = "dst"
        ns.update_queue(props)
        ns.forward_pending_messages()  # m1 is locked: forwarding keeps order, so it waits
        assert queue_ids(ns, "dst") == Counter()
        r.abandon_message(m)
    assert queue_ids(ns, "dst") == Counter({"m1": 1, "m2": 1})
    assert queue_ids(ns, "src") == Counter()


def test_a_send_that_landed_stands_when_forwarding_after_it_fails(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forwarding failure after a send or settle landed is logged, not raised (a caller would repeat the send)."""
    import sparkqueue.broker.core as core
    from sparkqueue.errors import OperationTimeoutError

    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")

    def failing(*args: object, **kwargs: object) -> list[str]:
        raise OperationTimeoutError("forwarding timed out")

    monkeypatch.setattr(core, "forward", failing)
    (seq,) = ns.get_queue_sender("src").send_messages(Message("x", message_id="m"))
    assert seq > 0
    monkeypatch.undo()
    assert queue_ids(ns, "dst") == Counter()
    ns.forward_pending_messages()
    assert queue_ids(ns, "dst") == Counter({"m": 1})


# ---- partition keys -------------------------------------------------------------------------------


def test_forwarding_keeps_partition_key(ns: Namespace) -> None:
    """A forwarded message lands in the destination partition its key selects (session id, partition key, message id)."""
    ns.create_queue("dst", requires_duplicate_detection=True)
    ns.create_queue("src", forward_to="dst", enable_partitioning=False)
    msgs = (
        [Message("p", message_id=f"p{i}", partition_key=f"pk-{i}") for i in range(8)]
        + [Message("s", message_id=f"s{i}", session_id=f"sess-{i}") for i in range(4)]
        + [Message("m", message_id=f"id-{i}") for i in range(8)]
    )
    ns.get_queue_sender("src").send_messages(msgs)
    with ns.get_queue_receiver("dst") as r:
        got = peek_all(r)
    assert len(got) == len(msgs)
    for m in got:
        key = m.session_id or m.partition_key or m.message_id
        assert m.partition_id == partition_for(key), m.message_id
        assert m.sequence_number >> 48 == m.partition_id


def test_forwarding_into_partitioned_topic_by_key(ns: Namespace) -> None:
    """Copies of a message forwarded into a partitioned topic sit in the partition of its key in every subscription."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.create_queue("src", forward_to="t", enable_partitioning=False)
    ns.get_queue_sender("src").send_messages([Message("x", message_id=f"m{i}", partition_key=f"key{i}") for i in range(10)])
    for sub in ("a", "b"):
        with ns.get_subscription_receiver("t", sub) as r:
            got = peek_all(r)
        assert sorted(m.message_id for m in got) == [f"m{i}" for i in range(10)]
        assert all(m.partition_id == partition_for(m.partition_key or "") for m in got)


def test_forwarding_session_messages(ns: Namespace) -> None:
    """Session messages forwarded into a session-enabled queue keep their session and order."""
    ns.create_queue("dst", requires_session=True)
    ns.create_queue("src", forward_to="dst")
    sender = ns.get_queue_sender("src")
    for i in range(5):
        sender.send_messages(Message(f"{i}", message_id=f"a{i}", session_id="A"))
    with ns.get_queue_receiver("dst", session_id="A") as r:
        got = drain(r, 5)
    assert [m.message_id for m in got] == [f"a{i}" for i in range(5)]
    assert all(m.partition_id == partition_for("A") for m in got)


def test_a_message_without_session_forwarded_into_a_session_queue_is_dead_lettered_there(ns: Namespace) -> None:
    """No session receiver could take it: it lands in the destination's dead letters (SessionIdRequired), never lost."""
    ns.create_queue("dst", requires_session=True)
    ns.create_queue("src", forward_to="dst")
    with ns.get_queue_sender("src") as sender:
        sender.send_messages([Message("s", message_id="with", session_id="A"), Message("n", message_id="without")])
    with ns.get_queue_receiver("dst", session_id="A") as r:
        assert [m.message_id for m in drain(r, 1)] == ["with"]
    with ns.get_queue_receiver("dst", sub_queue=SubQueue.DEAD_LETTER) as d:
        (dead,) = drain(d, 1)
    assert (dead.message_id, dead.dead_letter_reason) == ("without", "SessionIdRequired")
    assert dead.dead_letter_error_description == "the queue requires sessions and the message has no session_id"
    assert ns.get_queue_runtime_properties("src").total_message_count == 0


# ---- subscriptions and topics -------------------------------------------------------------------------


def test_subscription_forwards_to_queue(ns: Namespace) -> None:
    """A subscription with forward_to moves its matching copies to a queue; other subscriptions keep theirs."""
    ns.create_queue("q")
    ns.create_topic("t")
    ns.create_subscription("t", "fwd", forward_to="q")
    ns.delete_rule("t", "fwd", "$Default")
    ns.create_rule("t", "fwd", "even", filter=SqlRuleFilter("n % 2 = 0"))
    ns.create_subscription("t", "keep")
    ns.get_topic_sender("t").send_messages(
        [Message(f"{i}", message_id=f"m{i}", application_properties={"n": i}) for i in range(10)]
    )
    assert queue_ids(ns, "q") == Counter({f"m{i}": 1 for i in range(0, 10, 2)})
    assert sub_ids(ns, "t", "fwd") == Counter()
    assert sub_ids(ns, "t", "keep") == Counter({f"m{i}": 1 for i in range(10)})
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 5)
    assert all(m.application_properties == {"n": int(m.message_id[1:])} for m in got)


def test_queue_forwards_to_topic(ns: Namespace) -> None:
    """A queue forwarding to a topic fans its messages out to the topic's matching subscriptions."""
    ns.create_topic("t")
    ns.create_subscription("t", "all")
    ns.create_subscription("t", "red")
    ns.delete_rule("t", "red", "$Default")
    ns.create_rule("t", "red", "r", filter=SqlRuleFilter("color = 'red'"))
    ns.create_queue("q", forward_to="t")
    ns.get_queue_sender("q").send_messages(
        [Message("x", message_id=f"m{i}", application_properties={"color": "red" if i < 3 else "blue"}) for i in range(7)]
    )
    assert queue_ids(ns, "q") == Counter()
    assert sub_ids(ns, "t", "all") == Counter({f"m{i}": 1 for i in range(7)})
    assert sub_ids(ns, "t", "red") == Counter({f"m{i}": 1 for i in range(3)})


def test_topic_to_topic_through_subscription(ns: Namespace) -> None:
    """topic -> subscription -> topic -> subscription -> queue: each stage applies its own rules."""
    ns.create_queue("sink")
    ns.create_topic("t2")
    ns.create_subscription("t2", "s2", forward_to="sink")
    ns.delete_rule("t2", "s2", "$Default")
    ns.create_rule("t2", "s2", "big", filter=SqlRuleFilter("n > 2"))
    ns.create_topic("t1")
    ns.create_subscription("t1", "s1", forward_to="t2")
    ns.get_topic_sender("t1").send_messages([Message("x", message_id=f"m{i}", application_properties={"n": i}) for i in range(5)])
    assert queue_ids(ns, "sink") == Counter({"m3": 1, "m4": 1})
    assert sub_ids(ns, "t1", "s1") == Counter()
    assert sub_ids(ns, "t2", "s2") == Counter()


def test_topic_chain_hop_limit(ns: Namespace) -> None:
    """Hops through topics count too: a fifth hop is dead-lettered at the subscription that would make it."""
    # q0 -> t1/s1 -> q2 -> t3/s3 -> q4 -> q5 : the move q4 -> q5 is the 5th hop
    ns.create_queue("q5")
    ns.create_queue("q4", forward_to="q5")
    ns.create_topic("t3")
    ns.create_subscription("t3", "s3", forward_to="q4")
    ns.create_queue("q2", forward_to="t3")
    ns.create_topic("t1")
    ns.create_subscription("t1", "s1", forward_to="q2")
    ns.create_queue("q0", forward_to="t1")
    ns.get_queue_sender("q0").send_messages(Message("x", message_id="m"))
    assert queue_ids(ns, "q5") == Counter()
    assert queue_ids(ns, "q4", dead_letter=True) == Counter({"m": 1})
    with ns.get_queue_receiver("q4", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert m.dead_letter_reason == HOP_LIMIT


# ---- dead letters -------------------------------------------------------------------------------------


def test_queue_dead_letters_are_forwarded(ns: Namespace) -> None:
    """forward_dead_lettered_messages_to moves a queue's dead letters to another queue, keeping the reason."""
    ns.create_queue("dlq-target")
    ns.create_queue("q", forward_dead_lettered_messages_to="dlq-target")
    ns.get_queue_sender("q").send_messages([Message("bad", message_id="bad"), Message("ok", message_id="ok")])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 2):
            if m.message_id == "bad":
                r.dead_letter_message(m, reason="Poison", error_description="bad payload")
            else:
                r.complete_message(m)
    assert queue_ids(ns, "q", dead_letter=True) == Counter()
    assert queue_ids(ns, "q") == Counter()
    with ns.get_queue_receiver("dlq-target") as r:
        (m,) = drain(r, 1)
    assert (m.message_id, str(m), m.dead_letter_reason) == ("bad", "bad", "Poison")


def test_dead_letters_forwarded_in_any_order(ns: Namespace) -> None:
    """Dead letters are all forwarded whatever order they were dead-lettered in (none is lost)."""
    ns.create_queue("dlq-target")
    ns.create_queue("q", enable_partitioning=False, forward_dead_lettered_messages_to="dlq-target")
    ns.get_queue_sender("q").send_messages([Message(f"{i}", message_id=f"m{i}") for i in range(6)])
    with ns.get_queue_receiver("q") as r:
        got = sorted(drain(r, 6), key=lambda m: m.sequence_number)
        for i in (5, 2, 4, 0, 3, 1):  # highest sequence number first, then lower ones
            r.dead_letter_message(got[i], reason=f"r{i}")
    assert queue_ids(ns, "q", dead_letter=True) == Counter()
    with ns.get_queue_receiver("dlq-target") as r:
        arrived = {m.message_id: m.dead_letter_reason for m in drain(r, 6)}
    assert arrived == {f"m{i}": f"r{i}" for i in range(6)}


def test_unforwardable_dead_letters_stay_receivable(ns: Namespace) -> None:
    """Dead letters whose destination is missing stay in the dead-letter sub-queue and can be received there."""
    ns.create_queue("not-there")
    ns.create_queue("q", forward_dead_lettered_messages_to="not-there")
    ns.delete_queue("not-there")  # a destination must exist at create: it goes missing afterwards
    ns.get_queue_sender("q").send_messages(Message("x", message_id="m"))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
        r.dead_letter_message(m, reason="Mine")
    ns.forward_pending_messages()
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
        assert (m.message_id, m.dead_letter_reason) == ("m", "Mine")
        dlq.complete_message(m)
    assert queue_ids(ns, "q", dead_letter=True) == Counter()


def test_subscription_dead_letters_are_forwarded(ns: Namespace) -> None:
    """A subscription's dead letters go to its forward_dead_lettered_messages_to destination (a topic here)."""
    ns.create_topic("errors")
    ns.create_subscription("errors", "audit")
    ns.create_topic("t")
    ns.create_subscription("t", "s", forward_dead_lettered_messages_to="errors")
    ns.get_topic_sender("t").send_messages(Message("x", message_id="m"))
    with ns.get_subscription_receiver("t", "s") as r:
        (m,) = drain(r, 1)
        r.dead_letter_message(m, reason="Nope")
    assert sub_ids(ns, "t", "s", dead_letter=True) == Counter()
    assert sub_ids(ns, "errors", "audit") == Counter({"m": 1})


def test_expired_and_over_delivered_dead_letters_are_forwarded(ns: Namespace) -> None:
    """Dead letters from TTL expiry and MaxDeliveryCountExceeded reach the dead-letter destination and stay there.

    A dead letter travels without its TTL: the expired one used to get its 200 ms again at the target, expire there at
    once and, the target not dead-lettering on expiry (a plain central queue), vanish. A target's default TTL applies.
    """
    ns.create_queue("dlq-target")
    ns.create_queue("capped-target", default_message_time_to_live=timedelta(hours=1))
    for name, target in (("q", "dlq-target"), ("q2", "capped-target")):
        ns.create_queue(
            name,
            enable_partitioning=False,
            max_delivery_count=1,
            dead_lettering_on_message_expiration=True,
            forward_dead_lettered_messages_to=target,
        )
        ns.get_queue_sender(name).send_messages(
            [Message("x", message_id="expiring", time_to_live=timedelta(milliseconds=200)), Message("y", message_id="poison")]
        )
    time.sleep(0.4)
    for name in ("q", "q2"):
        with ns.get_queue_receiver(name) as r:
            (m,) = r.receive_messages(max_wait_time=2)
            assert m.message_id == "poison"
            r.abandon_message(m)
            assert r.receive_messages(max_wait_time=0.3) == []
    ns.forward_pending_messages()
    time.sleep(0.4)  # longer than the expired message's own TTL
    for name in ("q", "q2"):
        assert queue_ids(ns, name, dead_letter=True) == Counter()
    with ns.get_queue_receiver("dlq-target") as r:
        arrived = {m.message_id: m for m in peek_all(r)}
    assert sorted(arrived) == ["expiring", "poison"]
    assert arrived["poison"].dead_letter_reason == "MaxDeliveryCountExceeded"
    assert arrived["expiring"].dead_letter_reason == "TTLExpiredException"
    assert all(m.expires_at_utc is None for m in arrived.values())
    with ns.get_queue_receiver("capped-target") as r:
        capped = {m.message_id: m for m in peek_all(r)}
    assert sorted(capped) == ["expiring", "poison"]
    for m in capped.values():
        assert m.time_to_live == timedelta(hours=1)
        assert m.expires_at_utc == m.enqueued_time_utc + timedelta(hours=1)
    assert queue_ids(ns, "dlq-target", dead_letter=True) == Counter()


def test_forwarded_message_ttl_counts_from_arrival(ns: Namespace) -> None:
    """A forwarded message expires at its enqueued_time_utc at the destination plus its TTL."""
    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")
    ns.get_queue_sender("src").send_messages(Message("x", message_id="m", time_to_live=timedelta(minutes=5)))
    with ns.get_queue_receiver("dst") as r:
        (m,) = drain(r, 1)
    assert m.time_to_live == timedelta(minutes=5)
    assert m.expires_at_utc == m.enqueued_time_utc + timedelta(minutes=5)


def test_a_ttl_reaching_past_the_latest_instant_is_forwarded_as_no_expiry(ns: Namespace) -> None:
    """As at send: an expiry past year 9999 is stored as none, and the forwarding (and later sends) go on."""
    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")
    with ns.get_queue_sender("src") as s:
        s.send_messages(Message("long", message_id="long", time_to_live=timedelta(days=3_000_000)))
        s.send_messages(Message("next", message_id="next"))
    with ns.get_queue_receiver("dst") as r:
        got = {m.message_id: m for m in drain(r, 2)}
    assert got["long"].expires_at_utc is None and got["long"].time_to_live == timedelta(days=3_000_000)
    assert ns.get_queue_runtime_properties("src").total_message_count == 0


# ---- failures and recovery ------------------------------------------------------------------------------


def test_missing_destination_dead_letters_at_source(ns: Namespace) -> None:
    """A destination deleted after its source was set up dead-letters at the source with ForwardingDestinationNotFound."""
    ns.create_queue("nowhere")
    ns.create_queue("src", forward_to="nowhere")
    ns.delete_queue("nowhere")
    ns.get_queue_sender("src").send_messages(batch("m", 4))
    assert queue_ids(ns, "src") == Counter()
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        got = drain(dlq, 4)
    assert sorted(m.message_id for m in got) == [f"m{i}" for i in range(4)]
    assert {m.dead_letter_reason for m in got} == {MISSING}
    # once the destination exists, later messages travel; the dead letters stay where they are
    ns.create_queue("nowhere")
    ns.get_queue_sender("src").send_messages(Message("later", message_id="later"))
    assert queue_ids(ns, "nowhere") == Counter({"later": 1})
    assert sum(queue_ids(ns, "src", dead_letter=True).values()) == 4


def test_a_missing_destination_is_refused_at_create_and_update(ns: Namespace) -> None:
    """As in Service Bus, a destination must exist when it is set: a typo is refused, not dead-lettered; nothing changes."""
    ns.create_queue("orders-archive")
    ns.create_topic("t")
    for setting in ("forward_to", "forward_dead_lettered_messages_to"):
        with pytest.raises(EntityNotFoundError, match="orders-archiv'"):
            ns.create_queue("orders", **{setting: "orders-archiv"})
        with pytest.raises(EntityNotFoundError, match="orders-archiv'"):
            ns.create_subscription("t", "s", **{setting: "orders-archiv"})
    assert [q.name for q in ns.list_queues()] == ["orders-archive"]
    assert ns.list_subscriptions("t") == []
    ns.create_queue("orders")
    ns.create_subscription("t", "s")
    for setting in ("forward_to", "forward_dead_lettered_messages_to"):
        with pytest.raises(EntityNotFoundError, match="orders-archiv'"):
            ns.update_queue(ns.get_queue("orders"), **{setting: "orders-archiv"})
        with pytest.raises(EntityNotFoundError, match="orders-archiv'"):
            ns.update_subscription("t", ns.get_subscription("t", "s"), **{setting: "orders-archiv"})
    assert ns.get_queue("orders").forward_to is ns.get_queue("orders").forward_dead_lettered_messages_to is None
    assert ns.get_subscription("t", "s").forward_to is ns.get_subscription("t", "s").forward_dead_lettered_messages_to is None


def test_an_existing_queue_or_topic_in_any_case_is_a_destination(ns: Namespace) -> None:
    """A destination is any queue or topic of the namespace, named in any case; a queue's dead letters may go back into it."""
    ns.create_queue("Archive")
    ns.create_topic("Events")
    ns.create_queue("q1", forward_to="archive", forward_dead_lettered_messages_to="EVENTS")
    ns.create_queue("q2", forward_dead_lettered_messages_to="Q2")  # itself: it exists once created
    ns.create_subscription("events", "s", forward_to="ARCHIVE", forward_dead_lettered_messages_to="events")  # its topic
    assert (ns.get_queue("q1").forward_to, ns.get_queue("q2").forward_dead_lettered_messages_to) == ("archive", "Q2")
    assert ns.get_subscription("events", "s").forward_dead_lettered_messages_to == "events"


def test_an_update_may_keep_a_destination_deleted_since(ns: Namespace) -> None:
    """Updating another setting keeps a forward whose destination was deleted (it dead-letters); changing to one is refused."""
    ns.create_queue("dst")
    ns.create_topic("t")
    ns.create_queue("src", forward_to="dst", forward_dead_lettered_messages_to="dst")
    ns.create_subscription("t", "s", forward_to="dst", forward_dead_lettered_messages_to="dst")
    ns.delete_queue("dst")
    ns.update_queue(ns.get_queue("src"), max_delivery_count=3)
    ns.update_subscription("t", ns.get_subscription("t", "s"), max_delivery_count=3, forward_to="DST")
    assert (ns.get_queue("src").max_delivery_count, ns.get_queue("src").forward_to) == (3, "dst")
    assert ns.get_subscription("t", "s").forward_to == "DST"
    ns.create_queue("other")
    ns.update_queue(ns.get_queue("src"), forward_to="other")
    with pytest.raises(EntityNotFoundError, match="'dst'"):
        ns.update_queue(ns.get_queue("src"), forward_to="dst")  # no longer the one it has: must exist again
    assert ns.get_queue("src").forward_to == "other"


def test_subscription_missing_destination(ns: Namespace) -> None:
    """A subscription forwarding to a deleted queue dead-letters its copies at the subscription."""
    ns.create_queue("q")
    ns.create_topic("t")
    ns.create_subscription("t", "s", forward_to="q")
    ns.create_subscription("t", "other")
    ns.delete_queue("q")
    ns.get_topic_sender("t").send_messages(Message("x", message_id="m"))
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
    assert (m.message_id, m.dead_letter_reason) == ("m", MISSING)
    assert sub_ids(ns, "t", "other") == Counter({"m": 1})


def test_forward_to_set_later_moves_waiting_messages(ns: Namespace) -> None:
    """Setting forward_to on a queue with waiting messages moves them with forward_pending_messages()."""
    ns.create_queue("dst")
    ns.create_queue("src")
    ns.get_queue_sender("src").send_messages(batch("m", 5))
    props = ns.get_queue("src")
    props.forward_to = "dst"
    ns.update_queue(props)
    assert ns.get_queue("src").forward_to == "dst"
    ns.forward_pending_messages()
    assert queue_ids(ns, "src") == Counter()
    assert queue_ids(ns, "dst") == Counter({f"m{i}": 1 for i in range(5)})
    ns.forward_pending_messages()  # idempotent
    assert queue_ids(ns, "dst") == Counter({f"m{i}": 1 for i in range(5)})


def test_subscription_forward_to_set_by_update(ns: Namespace) -> None:
    """forward_to set on a subscription by update_subscription applies to the next send."""
    ns.create_queue("q")
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    sender = ns.get_topic_sender("t")
    sender.send_messages(Message("x", message_id="before"))
    props = ns.get_subscription("t", "s")
    props.forward_to = "q"
    ns.update_subscription("t", props)
    sender.send_messages(Message("y", message_id="after"))
    assert queue_ids(ns, "q")["after"] == 1
    ns.forward_pending_messages()  # moves what was waiting before forward_to was set
    assert queue_ids(ns, "q") == Counter({"before": 1, "after": 1})
    assert sub_ids(ns, "t", "s") == Counter()
    props.forward_to = None
    ns.update_subscription("t", props)
    sender.send_messages(Message("z", message_id="kept"))
    assert sub_ids(ns, "t", "s") == Counter({"kept": 1})


def test_invalid_forward_to_name(ns: Namespace) -> None:
    """forward_to must be a valid entity name (InvalidOperationError), also on update."""
    with pytest.raises(InvalidOperationError):
        ns.create_queue("q", forward_to="bad//name")
    ns.create_queue("q")
    props = ns.get_queue("q")
    props.forward_dead_lettered_messages_to = "-bad"
    with pytest.raises(InvalidOperationError):
        ns.update_queue(props)
    assert ns.get_queue("q").forward_dead_lettered_messages_to is None


def test_scheduled_message_keeps_its_time_when_forwarded(ns: Namespace) -> None:
    """A scheduled message is forwarded at once but stays invisible at the destination until its time."""
    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")
    when = datetime.now(UTC) + timedelta(seconds=1.5)
    ns.get_queue_sender("src").schedule_messages(Message("later", message_id="s"), when)
    assert queue_ids(ns, "src") == Counter()
    assert ns.get_queue_runtime_properties("dst").scheduled_message_count == 1
    with ns.get_queue_receiver("dst") as r:
        assert r.receive_messages(max_wait_time=0.2) == []
        time.sleep(max(0.0, (when - datetime.now(UTC)).total_seconds()) + 0.1)
        (m,) = drain(r, 1)
    assert m.message_id == "s"
    assert m.enqueued_time_utc == m.scheduled_enqueue_time_utc  # enqueued when visible, as a send there stores it


def test_a_scheduled_message_dead_lettered_at_once_is_a_dead_letter_that_no_cancel_removes(ns: Namespace) -> None:
    """Its scheduled time is still ahead, but it is a dead letter: peeked as active; cancel_scheduled_messages deleted it."""
    ns.create_queue("nowhere")
    ns.create_queue("src", forward_to="nowhere")
    ns.delete_queue("nowhere")  # deleted after the source was set up: the forward dead-letters at once
    with ns.get_queue_sender("src") as s:
        seqs = s.schedule_messages(Message("important"), datetime.now(UTC) + timedelta(hours=1))
        s.cancel_scheduled_messages(seqs)
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert [(m.state, m.dead_letter_reason) for m in peek_all(dlq)] == [("active", MISSING)]
        assert [str(m) for m in drain(dlq, 1)] == ["important"]
    props = ns.get_queue_runtime_properties("src")
    assert (props.dead_letter_message_count, props.scheduled_message_count) == (1, 0)


def test_a_long_run_of_expired_messages_is_expired_batch_by_batch_then_the_rest_travels(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiring first recursed once per batch of expired messages: a long run ended in RecursionError, raised to
    a send whose commit had landed, and the messages behind it were never forwarded."""
    from sparkqueue.model import forwarding

    monkeypatch.setattr(forwarding, "BATCH", 2)
    ns.create_queue("dst")
    ns.create_queue("src", enable_partitioning=False, dead_lettering_on_message_expiration=True)
    with ns.get_queue_sender("src") as s:
        s.send_messages([Message(f"e{i}", time_to_live=timedelta(seconds=1)) for i in range(200)] + [Message("live")])
    time.sleep(1.2)
    props = ns.get_queue("src")
    props.forward_to = "dst"
    ns.update_queue(props)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)  # room for one batch's calls, not for 100 nested batches
    try:
        ns.forward_pending_messages()
    finally:
        sys.setrecursionlimit(limit)
    with ns.get_queue_receiver("dst") as r:
        assert [str(m) for m in drain(r, 1)] == ["live"]
    assert ns.get_queue_runtime_properties("src").dead_letter_message_count == 200


def test_duplicate_detection_at_destination(ns: Namespace) -> None:
    """A duplicate-detecting destination drops a forwarded message whose id it already accepted."""
    ns.create_queue("dst", requires_duplicate_detection=True)
    ns.create_queue("src", forward_to="dst")
    sender = ns.get_queue_sender("src")
    sender.send_messages(Message("1", message_id="same"))
    sender.send_messages(Message("2", message_id="same"))
    assert queue_ids(ns, "src") == Counter()
    assert queue_ids(ns, "dst") == Counter({"same": 1})


def test_dead_letters_forwarded_into_a_duplicate_detecting_queue_are_never_dropped(ns: Namespace) -> None:
    """Dead letters reach a duplicate-detecting destination that accepted their ids; later sends of those ids are duplicates."""
    ns.create_queue("dst", requires_duplicate_detection=True)
    ns.create_queue("src", forward_dead_lettered_messages_to="dst")
    ns.get_queue_sender("dst").send_messages(Message("direct", message_id="a"))
    ns.get_queue_sender("src").send_messages([Message("dead", message_id="a"), Message("dead", message_id="b")])
    with ns.get_queue_receiver("src") as r:
        for m in drain(r, 2):
            r.dead_letter_message(m, reason="Poison")
    assert queue_ids(ns, "src", dead_letter=True) == Counter()
    assert queue_ids(ns, "dst") == Counter({"a": 2, "b": 1})
    ns.get_queue_sender("dst").send_messages([Message("again", message_id="a"), Message("again", message_id="b")])
    with ns.get_queue_receiver("dst") as r:
        got = drain(r, 3)
    assert sorted((m.message_id, str(m)) for m in got) == [("a", "dead"), ("a", "direct"), ("b", "dead")]


def test_a_duplicate_detecting_queue_takes_its_own_dead_letters_back(ns: Namespace) -> None:
    """A queue forwarding its dead letters back into itself gets them back, though its window holds their ids."""
    ns.create_queue("q", requires_duplicate_detection=True)
    ns.update_queue(ns.get_queue("q"), forward_dead_lettered_messages_to="q")
    ns.get_queue_sender("q").send_messages(Message("body", message_id="x"))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
        r.dead_letter_message(m, reason="Retry later")
        (back,) = drain(r, 1)
        assert (back.message_id, str(back), back.dead_letter_reason, back.delivery_count) == ("x", "body", "Retry later", 0)
        r.complete_message(back)
    assert queue_ids(ns, "q") == Counter()
    assert queue_ids(ns, "q", dead_letter=True) == Counter()


def test_forwarding_by_another_process_namespace(root: str) -> None:
    """Messages stored by one client are forwarded by another client's forward_pending_messages()."""
    with Namespace(root) as a:
        a.create_queue("dst")
        a.create_queue("src", forward_to="dst")
        props = a.get_queue("src")
        props.forward_to = None
        a.update_queue(props)
        a.get_queue_sender("src").send_messages(batch("m", 6))
        props.forward_to = "dst"
        a.update_queue(props)
    with Namespace(root) as b:
        b.forward_pending_messages()
        assert queue_ids(b, "dst") == Counter({f"m{i}": 1 for i in range(6)})
        assert queue_ids(b, "src") == Counter()


# ---- transactions ------------------------------------------------------------------------------------


def test_transaction_send_is_forwarded(ns: Namespace) -> None:
    """Messages sent in a transaction to a forwarding queue are forwarded like any other send."""
    ns.create_queue("dst")
    ns.create_queue("src", forward_to="dst")
    sender = ns.get_queue_sender("src")
    with ns.transaction():
        sender.send_messages([Message(f"{i}", message_id=f"m{i}", partition_key="k") for i in range(3)])
    assert queue_ids(ns, "dst") == Counter({f"m{i}": 1 for i in range(3)})
    assert queue_ids(ns, "src") == Counter()


def test_transaction_send_to_topic_fans_out(ns: Namespace) -> None:
    """Messages sent in a transaction to a topic reach its matching subscriptions."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.delete_rule("t", "b", "$Default")
    ns.create_rule("t", "b", "r", filter=SqlRuleFilter("n = 1"))
    sender = ns.get_topic_sender("t")
    with ns.transaction():
        sender.send_messages(
            [Message(f"{i}", message_id=f"m{i}", partition_key="k", application_properties={"n": i}) for i in range(3)]
        )
    assert sub_ids(ns, "t", "a") == Counter({f"m{i}": 1 for i in range(3)})
    assert sub_ids(ns, "t", "b") == Counter({"m1": 1})


def test_a_subscription_as_destination_is_named_as_such(ns: Namespace) -> None:
    """forward_to a subscription said "no queue or topic of that name exists"; it says what is wrong now."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    for target in ("t/s", "T/S"):  # the long form "t/Subscriptions/s" is refused as a name already
        with pytest.raises(InvalidOperationError, match=r"names subscription .*forwarded to a queue or topic"):
            ns.create_queue("q", forward_to=target)
    assert [q.name for q in ns.list_queues()] == []


def test_a_deferred_dead_letter_is_not_forwarded(ns: Namespace) -> None:
    """A dead letter a receiver of the dead-letter sub-queue deferred stays there for receive_deferred_messages.

    Before, forwarding the dead letters took it too: it arrived active at the destination and was gone from the source.
    """
    ns.create_queue("dst")
    ns.create_queue("src")
    with ns.get_queue_sender("src") as s:
        s.send_messages([Message("d", message_id="d"), Message("e", message_id="e")])
    with ns.get_queue_receiver("src") as r:
        for m in drain(r, 2):
            r.dead_letter_message(m, reason="bad")
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        got = {m.message_id: m for m in drain(dlq, 2)}
        d = got["d"]
        dlq.defer_message(d)
        dlq.abandon_message(got["e"])
    ns.update_queue(ns.get_queue("src"), forward_dead_lettered_messages_to="dst")  # forwards the dead letters waiting
    assert queue_ids(ns, "dst") == Counter({"e": 1})
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (again,) = dlq.receive_deferred_messages(d.sequence_number)
        assert again.message_id == "d"


@pytest.mark.parametrize("route", ["kept", "removed"])
def test_a_claim_of_the_older_token_format_is_finished_or_released(ns: Namespace, route: str) -> None:
    """A namespace written by an older version may hold dead letters claimed as `forward:<id>` (no time, no destination):
    with the route still set the next forward finishes the claim; with the route removed it releases the dead letter."""
    from sparkqueue.model import lifecycle
    from sparkqueue.model.entity import ROW_COLUMNS
    from sparkqueue.storage.table import OP_SET

    ns.create_queue("dst")
    ns.create_queue("src", enable_partitioning=False)
    with ns.get_queue_sender("src") as s:
        s.send_messages(Message("d", message_id="d"))
    with ns.get_queue_receiver("src") as r:
        (m,) = drain(r, 1)
        r.dead_letter_message(m, reason="bad")
    entity = ns.broker.entity("queue", "src")
    dt = entity.table.snapshot()
    row = entity.table.scan(dt, 0, ROW_COLUMNS)
    claim = lifecycle.changes(row, OP_SET, lock_token="forward:0123abcd", locked_until_utc=None, available_at_utc=None)
    entity.table.apply(dt, 0, claim)
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert dlq.receive_messages(max_wait_time=0.5) == []  # claimed
    if route == "kept":
        ns.update_queue(ns.get_queue("src"), forward_dead_lettered_messages_to="dst")  # forwards what waits
        assert queue_ids(ns, "dst") == Counter({"d": 1})
        assert queue_ids(ns, "src", dead_letter=True) == Counter()
    else:
        ns.forward_pending_messages()
        with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as dlq:
            assert [x.message_id for x in dlq.receive_messages(max_wait_time=5)] == ["d"]


def test_dead_letters_forwarded_to_a_topic_no_subscription_takes_leave_the_source(ns: Namespace) -> None:
    """Dead letters forwarded to a topic whose only subscription's filter selects none of them go (as any message no
    rule selects), once. Before, the append stored nothing and recorded nothing, so the claim's outcome was unknown."""
    ns.create_topic("t")
    ns.create_subscription("t", "none")
    ns.delete_rule("t", "none", "$Default")
    ns.create_rule("t", "none", "never", filter=SqlRuleFilter("1 = 0"))
    ns.create_queue("src", forward_dead_lettered_messages_to="t")
    ns.get_queue_sender("src").send_messages(batch("m", 3))
    with ns.get_queue_receiver("src") as r:
        for m in drain(r, 3):
            r.dead_letter_message(m, reason="bad")
    ns.forward_pending_messages()
    assert queue_ids(ns, "src", dead_letter=True) == Counter()
    assert sub_ids(ns, "t", "none") == Counter()


def test_a_receive_waiting_when_forward_to_is_set_takes_nothing_after(root: str) -> None:
    """A receive waiting for messages (max_wait_time) when another process sets forward_to: it kept polling the main
    sub-queue, which the forwarders now own, and could take a message they also forwarded. It now stops polling
    with InvalidOperationError, as a receive started after the change does."""
    import threading

    from sparkqueue import ReceiveMode

    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src")
    outcome: dict[str, object] = {}
    started = threading.Event()

    def waiting() -> None:
        with Namespace(root) as other, other.get_queue_receiver("src", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
            started.set()
            try:
                outcome["got"] = [m.message_id for m in r.receive_messages(5, max_wait_time=15)]
            except InvalidOperationError as exc:
                outcome["refused"] = str(exc)

    thread = threading.Thread(target=waiting)
    thread.start()
    assert started.wait(30)
    time.sleep(0.3)  # the receive is polling
    with Namespace(root) as ns:
        ns.update_queue(ns.get_queue("src"), forward_to="dst")
        ns.get_queue_sender("src").send_messages(Message("m1", message_id="m1"))
        thread.join(60)
        assert "refused" in outcome and "forward" in str(outcome["refused"]), outcome
        assert queue_ids(ns, "dst") == Counter({"m1": 1})


def test_a_forward_put_off_by_an_unavailable_destination_is_moved_by_the_destinations_receivers(ns: Namespace) -> None:
    """A forward that failed (the destination's partition unavailable for a moment) waited, unreceivable at the
    forwarding source, until the next send to that source partition or an explicit forward_pending_messages(),
    while other traffic flowed. Receivers of the destination now move what is owed to it (every few seconds)."""
    ns.create_queue("B")
    ns.create_queue("A", forward_to="B")
    key = "customer-42"
    assert partition_for("elsewhere") != partition_for(key)  # the later sends forward another partition
    injector = ns.broker.fault_injector("B")
    injector.fail(partition_for(key), ("write",))
    ns.get_queue_sender("A").send_messages(Message("payload", message_id="m1", partition_key=key))
    injector.heal()
    assert ns.get_queue_runtime_properties("A").active_message_count == 1  # put off, not lost
    with Namespace(ns.broker.root) as other:  # another client: its receivers know nothing of the failed forward
        others = [f"o{i}" for i in range(3)]
        other.get_queue_sender("A").send_messages([Message("x", message_id=m, partition_key="elsewhere") for m in others])
        with other.get_queue_receiver("B") as r:
            got = [m.message_id for m in drain(r, 4)]
    assert sorted(got) == ["m1", *others]
    assert ns.get_queue_runtime_properties("A").active_message_count == 0


def test_a_forward_put_off_is_moved_by_a_session_receiver_of_the_destination(ns: Namespace) -> None:
    """As above for a destination that requires sessions: accepting the next session forwards what is owed first."""
    from sparkqueue import NEXT_AVAILABLE_SESSION

    ns.create_queue("B", requires_session=True)
    ns.create_queue("A", forward_to="B")
    injector = ns.broker.fault_injector("B")
    injector.fail(partition_for("s1"), ("write",))
    ns.get_queue_sender("A").send_messages(Message("payload", message_id="m1", session_id="s1"))
    injector.heal()
    assert ns.get_queue_runtime_properties("A").active_message_count == 1
    with Namespace(ns.broker.root) as other, other.get_queue_receiver("B", session_id=NEXT_AVAILABLE_SESSION) as r:
        assert r.session is not None and r.session.session_id == "s1"
        assert [m.message_id for m in r.receive_messages(max_wait_time=1)] == ["m1"]


def test_a_receive_forwards_what_is_owed_for_a_bounded_time_and_the_next_receives_go_on(ns: Namespace) -> None:
    """A receive forwarded everything owed to its queue before receiving, whatever the backlog or the call's timeout:
    20,000 owed messages held up a receive with timeout=2 for 12 s on an object store. The pass now stops after its
    share of the call (a batch at most past it); the next receives go on with it, so everything arrives, once."""
    ns.create_queue("B", enable_partitioning=False)
    ns.create_queue("A", enable_partitioning=False, forward_to="B")
    injector = ns.broker.fault_injector("B")
    injector.fail(0, ("write",))
    with ns.get_queue_sender("A") as s:
        for b in range(20):
            s.send_messages([Message("x", message_id=f"m{b}-{i}") for i in range(1000)])
    injector.heal()
    assert ns.get_queue_runtime_properties("A").active_message_count == 20_000  # every forward put off
    got: Counter[str] = Counter()
    with Namespace(ns.broker.root) as other, other.get_queue_receiver("B") as r:
        first = r.receive_messages(max_message_count=1, max_wait_time=0.01, timeout=0.2)
        r.complete_messages(first)
        got.update(m.message_id for m in first)
        assert ns.get_queue_runtime_properties("A").active_message_count > 0  # the pass stopped in time
        while sum(got.values()) < 20_000:
            batch = r.receive_messages(max_message_count=1000, max_wait_time=5)
            assert batch, f"stalled at {sum(got.values())}"
            r.complete_messages(batch)
            got.update(m.message_id for m in batch)
    assert len(got) == 20_000 and set(got.values()) == {1}
    assert ns.get_queue_runtime_properties("A").active_message_count == 0


def test_a_pass_over_owed_forwards_moves_a_batch_even_when_its_time_is_spent_before_it(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a slow store, reading the catalog and the source took longer than the pass's budget, so no batch ever
    started and every receive repeated the pass for nothing. Each source a pass starts now forwards one batch."""
    from sparkqueue.broker import core

    monkeypatch.setattr(core, "OWED_BUDGET_S", 0.0)  # a budget spent before the first batch, as on a slow store
    ns.create_queue("B", enable_partitioning=False)
    ns.create_queue("A", enable_partitioning=False, forward_to="B")
    injector = ns.broker.fault_injector("B")
    injector.fail(0, ("write",))
    ns.get_queue_sender("A").send_messages([Message("x", message_id=f"m{i}") for i in range(5)])
    injector.heal()
    with Namespace(ns.broker.root) as other, other.get_queue_receiver("B") as r:
        got = r.receive_messages(max_message_count=10, max_wait_time=1)
    assert sorted(m.message_id for m in got) == [f"m{i}" for i in range(5)]


def test_receive_deferred_messages_keeps_its_timeout_during_a_route_rest(ns: Namespace) -> None:
    """receive_deferred_messages waits out a rest after a forward_to change (a forwarder by the old route may still
    move the message); with a call timeout shorter than the rest it slept the whole rest all the same. It now raises
    OperationTimeoutError at once, and the message is there for the next call."""
    from sparkqueue.errors import OperationTimeoutError

    ns.create_queue("D", enable_partitioning=False)
    ns.create_queue("Q", enable_partitioning=False)
    ns.get_queue_sender("Q").send_messages(Message("x", message_id="m1"))
    with ns.get_queue_receiver("Q") as r:
        (m,) = r.receive_messages(max_wait_time=1)
        r.defer_message(m)
    injector = ns.broker.fault_injector("D")
    injector.fail(0, ("write",))  # the deferred message would travel to D: its forward is put off
    ns.update_queue(ns.get_queue("Q"), forward_to="D")
    # The update that removes the route rests it for 1.5 s, and returns once the rest is over.
    update = threading.Thread(target=lambda: ns.update_queue(ns.get_queue("Q"), forward_to=None))
    update.start()
    time.sleep(0.3)
    injector.heal()
    with Namespace(ns.broker.root) as other, other.get_queue_receiver("Q") as r:
        with pytest.raises(OperationTimeoutError, match="forward_to"):
            r.receive_deferred_messages(m.sequence_number, timeout=0.2)
        assert [x.message_id for x in r.receive_deferred_messages(m.sequence_number)] == ["m1"]  # waits the rest out
    update.join()


def test_an_owed_pass_forwards_one_hop_past_its_time_and_takes_the_sources_in_turn(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each source an owed pass starts forwards one batch whatever the time, but its later hops used to get one
    each too: a queue forwarding into a topic whose 10 subscriptions forward on moved 11 batches in one pass (a
    receive with timeout=1 took 3 s on a slow store). Hops after the first now wait for the next pass. Passes also
    take the sources in turn (they were shuffled), so a pass with time for one source reaches each in as many passes."""
    from sparkqueue.broker import core

    monkeypatch.setattr(core, "OWED_BUDGET_S", 0.0)  # time for one source per pass, as on a slow store
    monkeypatch.setattr(core, "OWED_EVERY_S", 0.0)  # a pass at every receive
    ns.create_queue("B", enable_partitioning=False)
    ns.create_topic("T", enable_partitioning=False)
    for i in range(10):
        ns.create_subscription("T", f"s{i}", forward_to="B")
    ns.create_queue("A", enable_partitioning=False, forward_to="T")
    injector = ns.broker.fault_injector("T", "topic")
    injector.fail(0, ("write",))
    ns.get_queue_sender("A").send_messages([Message("x", message_id=f"m{i}") for i in range(5)])  # put off: owed
    injector.heal()
    got: Counter[str] = Counter()
    sizes = []
    with Namespace(ns.broker.root) as other, other.get_queue_receiver("B") as r:
        for _ in range(60):  # 11 sources, one reached per pass: A in 11 passes at most, then a subscription per pass
            batch = r.receive_messages(max_message_count=100, max_wait_time=0.01)
            r.complete_messages(batch)
            got.update(m.message_id for m in batch)
            sizes.append(len(batch))
            if sum(got.values()) == 50:
                break
    assert got == Counter({f"m{i}": 10 for i in range(5)}), (got, sizes)  # every copy once
    assert max(sizes) <= 5, sizes  # one subscription's batch per pass, never the whole fan-out at once


def _owed_to_dst(ns: Namespace, sources: list[str], per: int = 3) -> None:
    """Queue dst, and source queues forwarding to it that each owe it `per` messages (ids `<source>-<k>`): their own
    forwards were put off by dst's partition failing a moment."""
    ns.create_queue("dst", enable_partitioning=False)
    for name in sources:
        ns.create_queue(name, enable_partitioning=False, forward_to="dst")
    injector = ns.broker.fault_injector("dst")
    injector.fail(0, ("write",))
    for name in sources:
        ns.get_queue_sender(name).send_messages([Message("x", message_id=f"{name}-{k}") for k in range(per)])
    injector.heal()


def test_owed_passes_reach_every_source_while_other_sources_come_and_go(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes with time for one source take the sources in turn. A turn kept as a position in the list skipped a source
    for good while another forwarding queue was created and deleted between receives; a pass now takes first the
    sources not reached yet in the current turn."""
    from sparkqueue.broker import core

    monkeypatch.setattr(core, "OWED_BUDGET_S", 0.0)
    monkeypatch.setattr(core, "OWED_EVERY_S", 0.0)
    _owed_to_dst(ns, [f"s{i}" for i in range(2)])
    got: Counter[str] = Counter()
    with Namespace(ns.broker.root) as admin, Namespace(ns.broker.root) as other, other.get_queue_receiver("dst") as r:
        for n in range(12):
            if n % 2 == 0:
                admin.create_queue("a-tmp", enable_partitioning=False, forward_to="dst")
            else:
                admin.delete_queue("a-tmp")
            batch = r.receive_messages(max_message_count=100, max_wait_time=0.01)
            r.complete_messages(batch)
            got.update(m.message_id for m in batch)
    assert got == Counter({f"s{i}-{k}": 1 for i in range(2) for k in range(3)})


# A parent that imported sparkqueue forks eight short-lived receivers of dst, one after another; each prints the ids it
# received. The parent is a fresh process: no thread of a test run is forked with it.
FORKING = r"""
import json, multiprocessing, sys
from sparkqueue import Namespace
from sparkqueue.broker import core

core.OWED_BUDGET_S = 0.0  # time for one source per pass, as on a slow store

def receive_once(root, out):
    with Namespace(root) as ns, ns.get_queue_receiver("dst") as r:
        batch = r.receive_messages(max_message_count=100, max_wait_time=0.05)
        r.complete_messages(batch)
        out.put([m.message_id for m in batch])

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    for _ in range(8):
        child = ctx.Process(target=receive_once, args=(sys.argv[1], out))
        child.start()
        print(json.dumps(out.get(timeout=60)), flush=True)
        child.join(60)
"""


def test_receivers_forked_from_one_parent_start_their_owed_passes_at_different_sources(ns: Namespace, tmp_path: Path) -> None:
    """The turn's start is drawn per process so that short-lived receivers do not all begin with the same source. A
    generator of sparkqueue's own kept its parent's state in forked children: eight receivers forked after import all
    began with one source, and with time for one source per pass the four others were never reached."""
    _owed_to_dst(ns, [f"src{i}" for i in range(5)])
    script = tmp_path / "forking.py"
    script.write_text(FORKING)
    done = subprocess.run([sys.executable, str(script), ns.broker.root], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = Counter(i for line in done.stdout.splitlines() for i in json.loads(line))
    assert len({m.split("-")[0] for m in got}) > 1, got  # eight receivers, five sources: not all at the same one
    assert set(got.values()) == {1}
