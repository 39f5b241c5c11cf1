"""Topics and subscriptions (docs/semantics.md §8, §11): management, fan-out, duplicate detection, subscriptions as queues."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from procs import drain, drain_all, key_for_partition, partition_for, peek_all

from sparkqueue import (
    NEXT_AVAILABLE_SESSION,
    FalseRuleFilter,
    Message,
    Namespace,
    ReceiveMode,
    SqlRuleAction,
    SqlRuleFilter,
    SubQueue,
)
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    InvalidOperationError,
    PartitionUnavailableError,
    SessionCannotBeLockedError,
)


def ids_in(ns: Namespace, topic: str, sub: str, *, dead_letter: bool = False) -> Counter[str]:
    """message_id -> number of copies held by a subscription (or its dead-letter sub-queue)."""
    sub_queue = SubQueue.DEAD_LETTER if dead_letter else None
    with ns.get_subscription_receiver(topic, sub, sub_queue=sub_queue) as r:
        return Counter(m.message_id for m in peek_all(r))


def only_rule(ns: Namespace, topic: str, sub: str, sql: str) -> None:
    """Replace a subscription's $Default rule by one SQL filter."""
    ns.delete_rule(topic, sub, "$Default")
    ns.create_rule(topic, sub, "only", filter=SqlRuleFilter(sql))


# ---- topic management -----------------------------------------------------------------------------


def test_create_get_list_topic(ns: Namespace) -> None:
    """create_topic returns its settings; get_topic and list_topics show them; names are unique."""
    props = ns.create_topic("orders", requires_duplicate_detection=True)
    assert props.name == "orders"
    ns.create_topic("billing", enable_partitioning=False)
    got = ns.get_topic("orders")
    assert got.name == "orders"
    assert got.requires_duplicate_detection is True
    assert got.enable_partitioning is True
    assert ns.get_topic("billing").enable_partitioning is False
    assert sorted(t.name for t in ns.list_topics()) == ["billing", "orders"]
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_topic("orders")
    with pytest.raises(EntityNotFoundError):
        ns.get_topic("nope")
    with pytest.raises(EntityNotFoundError):
        ns.get_topic_runtime_properties("nope")
    with pytest.raises(EntityNotFoundError):
        ns.get_topic_sender("nope")


def test_topic_and_queue_names_do_not_mix(ns: Namespace) -> None:
    """A topic is not a queue: queue calls on a topic name raise EntityNotFoundError."""
    ns.create_topic("t")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue("t")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue_sender("t")
    assert ns.list_queues() == []


@pytest.mark.parametrize("name", ["", "-t", "t-", "a//b", "x" * 261, "sp ace", "a|b", 7])
def test_invalid_topic_names(ns: Namespace, name: object) -> None:
    """Invalid topic names raise InvalidOperationError and create nothing."""
    with pytest.raises(InvalidOperationError):
        ns.create_topic(name)  # type: ignore[arg-type]
    assert ns.list_topics() == []


def test_update_topic(ns: Namespace) -> None:
    """update_topic applies changed settings; partitioning and duplicate detection are fixed; unknown topics raise."""
    ns.create_topic("t")
    props = ns.get_topic("t")
    props.default_message_time_to_live = timedelta(hours=1)
    props.max_size_in_megabytes = 2048
    ns.update_topic(props)
    got = ns.get_topic("t")
    assert (got.default_message_time_to_live, got.max_size_in_megabytes) == (timedelta(hours=1), 2048)
    for fixed, value in (("enable_partitioning", False), ("requires_duplicate_detection", True)):
        changed = ns.get_topic("t")
        setattr(changed, fixed, value)
        with pytest.raises(InvalidOperationError, match=f"{fixed} is fixed at creation"):
            ns.update_topic(changed)
        assert getattr(ns.get_topic("t"), fixed) is not value
    ghost = ns.get_topic("t")
    ghost.name = "ghost"
    with pytest.raises(EntityNotFoundError):
        ns.update_topic(ghost)


def test_delete_topic_removes_subscriptions_rules_and_messages(ns: Namespace) -> None:
    """Deleting a topic deletes its subscriptions, rules and messages; a recreated topic starts empty."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_rule("t", "s", "extra", filter=SqlRuleFilter("a = 1"))
    ns.get_topic_sender("t").send_messages([Message("x", message_id="old")])
    ns.delete_topic("t")
    assert ns.list_topics() == []
    for call in (
        lambda: ns.get_topic("t"),
        lambda: ns.get_subscription("t", "s"),
        lambda: ns.list_subscriptions("t"),
        lambda: ns.get_rule("t", "s", "extra"),
        lambda: ns.delete_topic("t"),
    ):
        with pytest.raises(EntityNotFoundError):
            call()
    ns.create_topic("t")
    assert ns.list_subscriptions("t") == []
    ns.create_subscription("t", "s")
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    assert ids_in(ns, "t", "s") == Counter()


# ---- subscription management ----------------------------------------------------------------------


def test_create_get_list_subscriptions(ns: Namespace) -> None:
    """Subscriptions are created, read and listed per topic; the topic counts them; names are unique per topic."""
    ns.create_topic("t")
    ns.create_topic("u")
    props = ns.create_subscription("t", "a", lock_duration=timedelta(seconds=30), max_delivery_count=3)
    assert props.name == "a"
    ns.create_subscription("t", "b")
    ns.create_subscription("u", "a")  # the same name on another topic is fine
    got = ns.get_subscription("t", "a")
    assert (got.name, got.lock_duration, got.max_delivery_count) == ("a", timedelta(seconds=30), 3)
    assert ns.get_subscription("t", "b").lock_duration == timedelta(seconds=60)
    assert sorted(s.name for s in ns.list_subscriptions("t")) == ["a", "b"]
    assert [s.name for s in ns.list_subscriptions("u")] == ["a"]
    assert ns.get_topic_runtime_properties("t").subscription_count == 2
    assert ns.get_topic_runtime_properties("u").subscription_count == 1
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_subscription("t", "a")
    with pytest.raises(EntityNotFoundError):
        ns.create_subscription("missing", "a")
    with pytest.raises(EntityNotFoundError):
        ns.get_subscription("t", "zzz")
    with pytest.raises(EntityNotFoundError):
        ns.list_subscriptions("missing")
    with pytest.raises(EntityNotFoundError):
        ns.get_subscription_receiver("t", "zzz")
    with pytest.raises(EntityNotFoundError):
        ns.get_subscription_runtime_properties("t", "zzz")
    assert ns.get_subscription_runtime_properties("t", "a").name == "a"


def test_topic_counts_leave_out_a_deleted_subscriptions_messages(ns: Namespace) -> None:
    """Its rows stay in the topic's table until maintenance drops them; the topic counted them as active."""
    ns.create_topic("t")
    ns.create_subscription("t", "kept")
    ns.create_subscription("t", "gone")
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("a"), Message("b")])
    assert ns.get_topic_runtime_properties("t").active_message_count == 4
    ns.delete_subscription("t", "gone")
    props = ns.get_topic_runtime_properties("t")
    assert (props.active_message_count, props.total_message_count, props.subscription_count) == (2, 2, 1)
    ns.create_subscription("t", "gone")  # the same name again: a new subscription, without the old copies
    assert ns.get_topic_runtime_properties("t").active_message_count == 2


@pytest.mark.parametrize("name", ["$sub", "$Default", "", "a/b", "a|b", "x" * 51, "-a", "a b", None])
def test_invalid_subscription_names(ns: Namespace, name: object) -> None:
    """Invalid subscription names (including ones starting with '$') raise InvalidOperationError."""
    ns.create_topic("t")
    with pytest.raises(InvalidOperationError):
        ns.create_subscription("t", name)  # type: ignore[arg-type]
    assert ns.list_subscriptions("t") == []


def test_invalid_subscription_settings(ns: Namespace) -> None:
    """Bad subscription settings raise InvalidOperationError and create nothing."""
    ns.create_topic("t")
    for settings in (
        {"lock_duration": timedelta(minutes=6)},
        {"lock_duration": 30},
        {"max_delivery_count": 0},
        {"forward_to": "bad//name"},
        {"forward_dead_lettered_messages_to": "-x"},
        {"no_such_setting": True},
        {"requires_session": "yes"},
    ):
        with pytest.raises(InvalidOperationError):
            ns.create_subscription("t", "s", **settings)
    assert ns.list_subscriptions("t") == []


def test_update_subscription(ns: Namespace) -> None:
    """update_subscription applies changed settings; requires_session is fixed at creation."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    props = ns.get_subscription("t", "s")
    props.lock_duration = timedelta(seconds=5)
    props.max_delivery_count = 2
    props.dead_lettering_on_message_expiration = True
    ns.update_subscription("t", props)
    got = ns.get_subscription("t", "s")
    assert (got.lock_duration, got.max_delivery_count, got.dead_lettering_on_message_expiration) == (
        timedelta(seconds=5),
        2,
        True,
    )
    got.requires_session = True
    with pytest.raises(InvalidOperationError):
        ns.update_subscription("t", got)
    assert ns.get_subscription("t", "s").requires_session is False
    ghost = ns.get_subscription("t", "s")
    ghost.name = "ghost"
    with pytest.raises(EntityNotFoundError):
        ns.update_subscription("t", ghost)


def test_updated_lock_duration_applies_to_new_deliveries(ns: Namespace) -> None:
    """A subscription's lock_duration (also after an update) sets locked_until_utc of its deliveries."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "s", lock_duration=timedelta(seconds=20))
    ns.get_topic_sender("t").send_messages([Message("a"), Message("b")])
    with ns.get_subscription_receiver("t", "s") as r:
        (m,) = r.receive_messages(max_wait_time=2)
        left = (m.locked_until_utc - m.enqueued_time_utc).total_seconds()
        assert 15 < left < 80
        props = ns.get_subscription("t", "s")
        props.lock_duration = timedelta(minutes=4)
        ns.update_subscription("t", props)
        (m2,) = r.receive_messages(max_wait_time=2)
        assert (m2.locked_until_utc - m2.enqueued_time_utc).total_seconds() > 200


def test_delete_subscription(ns: Namespace) -> None:
    """delete_subscription removes it and its rules; the others keep receiving; deleting twice fails."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.create_rule("t", "a", "r", filter=SqlRuleFilter("x = 1"))
    ns.delete_subscription("t", "a")
    assert [s.name for s in ns.list_subscriptions("t")] == ["b"]
    assert ns.get_topic_runtime_properties("t").subscription_count == 1
    with pytest.raises(EntityNotFoundError):
        ns.get_subscription("t", "a")
    with pytest.raises(EntityNotFoundError):
        ns.list_rules("t", "a")
    with pytest.raises(EntityNotFoundError):
        ns.get_rule("t", "a", "r")
    with pytest.raises(EntityNotFoundError):
        ns.delete_subscription("t", "a")
    with pytest.raises(EntityNotFoundError):
        ns.delete_subscription("nope", "b")
    ns.get_topic_sender("t").send_messages([Message("x", message_id="m1")])
    assert ids_in(ns, "t", "b") == Counter({"m1": 1})


def test_recreated_subscription_does_not_resurrect_messages(ns: Namespace) -> None:
    """A subscription deleted and created again under the same name starts empty, with only $Default."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_subscription("t", "keep")
    ns.create_rule("t", "s", "old", filter=SqlRuleFilter("x = 1"))
    sender = ns.get_topic_sender("t")
    sender.send_messages([Message(f"old{i}", message_id=f"old{i}") for i in range(10)])
    with ns.get_subscription_receiver("t", "s") as r:
        dead = r.receive_messages(max_message_count=3, max_wait_time=2)
        assert dead
        r.dead_letter_message(dead[0], reason="old")
    ns.delete_subscription("t", "s")
    ns.create_subscription("t", "s")
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    assert ids_in(ns, "t", "s") == Counter()
    assert ids_in(ns, "t", "s", dead_letter=True) == Counter()
    rp = ns.get_subscription_runtime_properties("t", "s")
    assert (rp.active_message_count, rp.dead_letter_message_count, rp.total_message_count) == (0, 0, 0)
    with ns.get_subscription_receiver("t", "s") as r:
        assert r.receive_messages(max_message_count=10, max_wait_time=0.5) == []
    sender.send_messages([Message("new", message_id="new")])
    assert ids_in(ns, "t", "s") == Counter({"new": 1})
    assert ids_in(ns, "t", "keep") == Counter({**{f"old{i}": 1 for i in range(10)}, "new": 1})


# ---- fan-out ----------------------------------------------------------------------------------------


def test_fan_out_counts(ns: Namespace) -> None:
    """N messages reach each matching subscription exactly once; a message matching nothing is stored nowhere."""
    ns.create_topic("t")
    ns.create_subscription("t", "all")
    ns.create_subscription("t", "even")
    only_rule(ns, "t", "even", "n % 2 = 0")
    ns.create_subscription("t", "big")
    only_rule(ns, "t", "big", "n >= 30")
    ns.create_subscription("t", "none")
    only_rule(ns, "t", "none", "n < 0")
    sender = ns.get_topic_sender("t")
    n = 40
    seqs = sender.send_messages([Message(f"m{i}", message_id=f"m{i}", application_properties={"n": i}) for i in range(n)])
    expected = {
        "all": set(range(n)),
        "even": {i for i in range(n) if i % 2 == 0},
        "big": set(range(30, n)),
        "none": set(),
    }
    assert len(seqs) == sum(len(v) for v in expected.values())
    for sub, want in expected.items():
        got = ids_in(ns, "t", sub)
        assert got == Counter({f"m{i}": 1 for i in want}), sub
        assert ns.get_subscription_runtime_properties("t", sub).active_message_count == len(want)
    assert ns.get_topic_runtime_properties("t").active_message_count == sum(len(v) for v in expected.values())

    ns.delete_rule("t", "all", "$Default")
    ns.create_rule("t", "all", "r", filter=FalseRuleFilter())
    assert sender.send_messages([Message("lost", message_id="lost", application_properties={"n": "x"})]) == []
    for sub in expected:
        assert "lost" not in ids_in(ns, "t", sub)
    assert ns.get_topic_runtime_properties("t").total_message_count == sum(len(v) for v in expected.values())


def test_topic_without_subscriptions_stores_nothing(ns: Namespace) -> None:
    """A send to a topic with no subscription succeeds and a later subscription does not see the message."""
    ns.create_topic("t")
    assert ns.get_topic_sender("t").send_messages([Message("x", message_id="early")]) == []
    assert ns.get_topic_runtime_properties("t").total_message_count == 0
    ns.create_subscription("t", "late")
    assert ids_in(ns, "t", "late") == Counter()


def test_new_subscription_gets_only_later_messages(ns: Namespace) -> None:
    """A subscription receives the messages sent after its creation, not earlier ones."""
    ns.create_topic("t")
    ns.create_subscription("t", "first")
    sender = ns.get_topic_sender("t")
    sender.send_messages([Message("1", message_id="before")])
    ns.create_subscription("t", "second")
    sender.send_messages([Message("2", message_id="after")])
    assert ids_in(ns, "t", "first") == Counter({"before": 1, "after": 1})
    assert ids_in(ns, "t", "second") == Counter({"after": 1})


def test_copies_are_independent(ns: Namespace) -> None:
    """Settling a copy in one subscription leaves the other subscriptions' copies untouched."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.get_topic_sender("t").send_messages([Message("payload", message_id="m", subject="s1")])
    with ns.get_subscription_receiver("t", "a") as ra:
        (m,) = ra.receive_messages(max_wait_time=2)
        ra.complete_message(m)
    with ns.get_subscription_receiver("t", "b") as rb:
        (m,) = rb.receive_messages(max_wait_time=2)
        assert (m.message_id, m.body, m.subject, m.delivery_count) == ("m", b"payload", "s1", 0)
        rb.complete_message(m)
    assert ids_in(ns, "t", "a") == Counter()
    assert ids_in(ns, "t", "b") == Counter()


def test_fan_out_is_atomic_per_send(ns: Namespace) -> None:
    """A send either reaches every matching subscription or none: a failed keyed send stores no copy anywhere."""
    ns.create_topic("t")
    for s in ("a", "b", "c"):
        ns.create_subscription("t", s)
    good, bad = key_for_partition(3), key_for_partition(11)
    ns.fault_injector("t", "topic").fail(11)
    with pytest.raises(PartitionUnavailableError):
        ns.get_topic_sender("t").send_messages(
            [Message("1", message_id="ok", partition_key=good), Message("2", message_id="ko", partition_key=bad)]
        )
    ns.fault_injector("t", "topic").heal()
    for s in ("a", "b", "c"):
        assert ids_in(ns, "t", s) == Counter()
    ns.get_topic_sender("t").send_messages([Message("1", message_id="ok", partition_key=good)])
    for s in ("a", "b", "c"):
        assert ids_in(ns, "t", s) == Counter({"ok": 1})


def test_fan_out_visible_all_at_once(root: str) -> None:
    """A concurrent reader never sees part of a send's copies: the topic's totals move in whole batches."""
    subs, batch, batches = 3, 20, 8
    with Namespace(root) as ns:
        ns.create_topic("t")
        for i in range(subs):
            ns.create_subscription("t", f"s{i}")
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with Namespace(root) as reader:
            while not stop.is_set():
                seen.append(reader.get_topic_runtime_properties("t").total_message_count)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with Namespace(root) as ns, ns.get_topic_sender("t") as sender:
            for b in range(batches):
                sender.send_messages([Message("x", message_id=f"{b}-{i}") for i in range(batch)])
                time.sleep(0.02)
    finally:
        stop.set()
        watcher.join()
    assert seen
    assert all(total % (subs * batch) == 0 for total in seen), sorted(set(seen))
    with Namespace(root) as ns:
        assert ns.get_topic_runtime_properties("t").total_message_count == subs * batch * batches


def test_subscription_keeps_message_properties(ns: Namespace) -> None:
    """A copy carries the sent message's body, id and properties, placed by the same key."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    sent = Message(
        b"\x00\x01body",
        message_id="id-1",
        partition_key="pk",
        application_properties={"a": 1, "b": "two", "c": 1.5, "d": True},
        content_type="application/json",
        correlation_id="corr",
        subject="subj",
        to="to",
        reply_to="reply",
        reply_to_session_id="rsid",
        time_to_live=timedelta(hours=1),
    )
    ns.get_topic_sender("t").send_messages(sent)
    with ns.get_subscription_receiver("t", "s") as r:
        (m,) = drain(r, 1)
    assert m.body == b"\x00\x01body"
    assert (m.message_id, m.partition_key, m.content_type, m.correlation_id) == ("id-1", "pk", "application/json", "corr")
    assert (m.subject, m.to, m.reply_to, m.reply_to_session_id) == ("subj", "to", "reply", "rsid")
    assert m.application_properties == {"a": 1, "b": "two", "c": 1.5, "d": True}
    assert m.time_to_live == timedelta(hours=1)
    assert m.partition_id == partition_for("pk")


# ---- duplicate detection ------------------------------------------------------------------------------


def test_topic_duplicate_detection(ns: Namespace) -> None:
    """On a duplicate-detecting topic a repeated message_id gives every subscription one copy only."""
    ns.create_topic("t", requires_duplicate_detection=True)
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    sender = ns.get_topic_sender("t")
    sender.send_messages([Message("1", message_id="dup"), Message("2", message_id="other")])
    assert sender.send_messages([Message("1 again", message_id="dup")]) == []
    sender.send_messages([Message("x", message_id="batch"), Message("y", message_id="batch")])
    for s in ("a", "b"):
        assert ids_in(ns, "t", s) == Counter({"dup": 1, "other": 1, "batch": 1})
    # also after the first copy was completed in one subscription
    with ns.get_subscription_receiver("t", "a") as r:
        for m in drain(r, 3):
            r.complete_message(m)
    sender.send_messages([Message("late", message_id="dup")])
    assert ids_in(ns, "t", "a") == Counter()
    assert ids_in(ns, "t", "b") == Counter({"dup": 1, "other": 1, "batch": 1})


def test_topic_duplicate_detection_when_no_subscription_matched(ns: Namespace) -> None:
    """A message id accepted while no subscription matched is still a duplicate later."""
    ns.create_topic("t", requires_duplicate_detection=True)
    ns.create_subscription("t", "s")
    only_rule(ns, "t", "s", "color = 'red'")
    sender = ns.get_topic_sender("t")
    sender.send_messages([Message("blue", message_id="m1", application_properties={"color": "blue"})])
    sender.send_messages([Message("red", message_id="m1", application_properties={"color": "red"})])
    sender.send_messages([Message("red", message_id="m2", application_properties={"color": "red"})])
    assert ids_in(ns, "t", "s") == Counter({"m2": 1})
    assert ns.get_topic_runtime_properties("t").total_message_count == 1


def test_topic_duplicate_detection_ignores_ids_a_rule_action_set(ns: Namespace) -> None:
    """Only ids the topic accepted are duplicates: an id a rule action gave a copy does not drop a new message with it."""
    ns.create_topic("t", requires_duplicate_detection=True, enable_partitioning=False)
    ns.create_subscription("t", "s")
    ns.delete_rule("t", "s", "$Default")
    ns.create_rule("t", "s", "rename", filter=SqlRuleFilter("1 = 1"), action=SqlRuleAction("SET sys.MessageId = 'fixed'"))
    sender = ns.get_topic_sender("t")
    sender.send_messages(Message("first", message_id="m1"))
    assert len(sender.send_messages(Message("second", message_id="fixed"))) == 1
    assert sender.send_messages(Message("again", message_id="m1")) == []
    assert ids_in(ns, "t", "s") == Counter({"fixed": 2})


def test_topic_without_duplicate_detection_keeps_repeats(ns: Namespace) -> None:
    """Without duplicate detection a repeated message_id is delivered again."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    sender = ns.get_topic_sender("t")
    sender.send_messages([Message("1", message_id="dup")])
    sender.send_messages([Message("2", message_id="dup")])
    assert ids_in(ns, "t", "s") == Counter({"dup": 2})


# ---- subscriptions behave like queues ----------------------------------------------------------------


def test_subscription_peek_lock_complete_abandon(ns: Namespace) -> None:
    """Subscription messages are peek-locked, completed and abandoned like a queue's."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.get_topic_sender("t").send_messages([Message(f"{i}", message_id=f"m{i}") for i in range(6)])
    with ns.get_subscription_receiver("t", "s") as r, ns.get_subscription_receiver("t", "s") as other:
        got = drain(r, 6)
        assert sorted(m.message_id for m in got) == [f"m{i}" for i in range(6)]
        assert all(m.lock_token and m.delivery_count == 0 for m in got)
        assert other.receive_messages(max_message_count=6, max_wait_time=0.3) == []
        for m in got[:4]:
            r.complete_message(m)
        for m in got[4:]:
            r.abandon_message(m)
        again = drain(other, 2)
        assert sorted(m.message_id for m in again) == sorted(m.message_id for m in got[4:])
        assert all(m.delivery_count == 1 for m in again)
        for m in again:
            other.complete_message(m)
    assert ids_in(ns, "t", "s") == Counter()
    assert ns.get_subscription_runtime_properties("t", "s").total_message_count == 0


def test_subscription_receive_and_delete(ns: Namespace) -> None:
    """RECEIVE_AND_DELETE on a subscription removes its copies on receipt, leaving other subscriptions' copies."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.get_topic_sender("t").send_messages([Message(f"{i}", message_id=f"m{i}") for i in range(5)])
    with ns.get_subscription_receiver("t", "a", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        assert len(drain(r, 5)) == 5
    assert ids_in(ns, "t", "a") == Counter()
    assert sum(ids_in(ns, "t", "b").values()) == 5


def test_subscription_dead_letter_queue(ns: Namespace) -> None:
    """dead_letter_message moves a subscription copy to its own dead-letter sub-queue, receivable and settleable."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_subscription("t", "other")
    ns.get_topic_sender("t").send_messages([Message("bad", message_id="bad"), Message("good", message_id="good")])
    with ns.get_subscription_receiver("t", "s") as r:
        for m in drain(r, 2):
            if m.message_id == "bad":
                r.dead_letter_message(m, reason="Poison", error_description="cannot parse")
            else:
                r.complete_message(m)
    assert ids_in(ns, "t", "s") == Counter()
    assert ids_in(ns, "t", "s", dead_letter=True) == Counter({"bad": 1})
    assert ids_in(ns, "t", "other", dead_letter=True) == Counter()
    rp = ns.get_subscription_runtime_properties("t", "s")
    assert (rp.active_message_count, rp.dead_letter_message_count) == (0, 1)
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
        assert (m.message_id, m.dead_letter_reason, m.dead_letter_error_description) == ("bad", "Poison", "cannot parse")
        assert m.dead_letter_source is None or "s" in m.dead_letter_source
        dlq.complete_message(m)
    assert ids_in(ns, "t", "s", dead_letter=True) == Counter()


def test_subscription_max_delivery_count(ns: Namespace) -> None:
    """A subscription's max_delivery_count dead-letters a copy with MaxDeliveryCountExceeded."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "s", max_delivery_count=2)
    ns.create_subscription("t", "patient")
    ns.get_topic_sender("t").send_messages([Message("x", message_id="m")])
    with ns.get_subscription_receiver("t", "s") as r:
        for _ in range(2):
            (m,) = r.receive_messages(max_wait_time=2)
            r.abandon_message(m)
        assert r.receive_messages(max_wait_time=0.3) == []
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
        assert m.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert ids_in(ns, "t", "patient") == Counter({"m": 1})


def test_subscription_ttl_expiry_dead_letters(ns: Namespace) -> None:
    """An expired copy is dead-lettered (TTLExpiredException) in a subscription with dead_lettering_on_message_expiration."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "dl", dead_lettering_on_message_expiration=True)
    ns.create_subscription("t", "drop")
    ns.get_topic_sender("t").send_messages(
        [Message("short", message_id="short", time_to_live=timedelta(milliseconds=300)), Message("long", message_id="long")]
    )
    time.sleep(0.6)
    for sub in ("dl", "drop"):
        with ns.get_subscription_receiver("t", sub) as r:
            got = drain_all(r)
            assert [m.message_id for m in got] == ["long"]
    assert ids_in(ns, "t", "dl", dead_letter=True) == Counter({"short": 1})
    assert ids_in(ns, "t", "drop", dead_letter=True) == Counter()
    with ns.get_subscription_receiver("t", "dl", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        (m,) = drain(dlq, 1)
        assert m.dead_letter_reason == "TTLExpiredException"


def test_subscription_default_ttl(ns: Namespace) -> None:
    """A subscription's default_message_time_to_live caps the TTL of its copies (the smaller one wins)."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "short", default_message_time_to_live=timedelta(milliseconds=300))
    ns.create_subscription("t", "forever")
    ns.get_topic_sender("t").send_messages([Message("x", message_id="m")])
    time.sleep(0.6)
    with ns.get_subscription_receiver("t", "short") as r:
        assert r.receive_messages(max_wait_time=0.3) == []
    with ns.get_subscription_receiver("t", "forever") as r:
        assert [m.message_id for m in r.receive_messages(max_wait_time=2)] == ["m"]


def test_subscription_deferral(ns: Namespace) -> None:
    """Deferred subscription copies are only delivered by receive_deferred_messages."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.get_topic_sender("t").send_messages([Message("later", message_id="later"), Message("now", message_id="now")])
    with ns.get_subscription_receiver("t", "s") as r:
        got = {m.message_id: m for m in drain(r, 2)}
        r.defer_message(got["later"])
        r.complete_message(got["now"])
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
        assert ns.get_subscription_runtime_properties("t", "s").deferred_message_count == 1
        (m,) = r.receive_deferred_messages([got["later"].sequence_number])
        assert m.message_id == "later"
        r.complete_message(m)
    assert ns.get_subscription_runtime_properties("t", "s").total_message_count == 0


def test_subscription_scheduled_messages(ns: Namespace) -> None:
    """A scheduled message sent to a topic stays invisible in every subscription until its time."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    when = datetime.now(UTC) + timedelta(seconds=1.5)
    ns.get_topic_sender("t").schedule_messages(Message("later", message_id="sched"), when)
    for s in ("a", "b"):
        assert ns.get_subscription_runtime_properties("t", s).scheduled_message_count == 1
        with ns.get_subscription_receiver("t", s) as r:
            assert r.receive_messages(max_wait_time=0.2) == []
    time.sleep(max(0.0, (when - datetime.now(UTC)).total_seconds()) + 0.1)
    for s in ("a", "b"):
        with ns.get_subscription_receiver("t", s) as r:
            assert [m.message_id for m in drain(r, 1)] == ["sched"]


def test_session_subscription(ns: Namespace) -> None:
    """A session-enabled subscription delivers each session's copies in order to the session's holder only."""
    ns.create_topic("t")
    ns.create_subscription("t", "s", requires_session=True)
    ns.create_subscription("t", "plain")
    sender = ns.get_topic_sender("t")
    for i in range(4):
        sender.send_messages([Message(f"a{i}", session_id="A", message_id=f"a{i}"), Message(f"b{i}", session_id="B")])
    with pytest.raises(InvalidOperationError):
        ns.get_subscription_receiver("t", "s")
    with ns.get_subscription_receiver("t", "s", session_id="A") as ra:
        assert ra.session is not None and ra.session.session_id == "A"
        got = drain(ra, 4)
        assert [m.message_id for m in got] == [f"a{i}" for i in range(4)]
        assert all(m.session_id == "A" for m in got)
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_subscription_receiver("t", "s", session_id="A")
        ra.session.set_state(b"progress")
        for m in got:
            ra.complete_message(m)
    with ns.get_subscription_receiver("t", "s", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as rb:
        assert rb.session is not None and rb.session.session_id == "B"
        assert len(drain(rb, 4)) == 4
    with ns.get_subscription_receiver("t", "s", session_id="A") as ra:
        assert ra.session is not None and ra.session.get_state() == b"progress"
    sessions = {s.session_id for s in ns.list_subscription_sessions("t", "s")}
    assert {"A", "B"} <= sessions
    assert sum(ids_in(ns, "t", "plain").values()) == 8


def test_topic_schedule_gives_one_number_per_message(ns: Namespace) -> None:
    """schedule_messages on a topic returns one number per message; cancelling it removes every subscription's copy."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    ns.create_rule("t", "b", "tagged", action=SqlRuleAction("SET via = 'b'"))  # b holds two copies of each message
    sender = ns.get_topic_sender("t")
    when = datetime.now(UTC) + timedelta(minutes=5)
    keys = [key_for_partition(3), key_for_partition(9), key_for_partition(5)]
    seqs = sender.schedule_messages([Message(k, message_id=f"m{i}", partition_key=k) for i, k in enumerate(keys)], when)
    assert [s >> 48 for s in seqs] == [3, 9, 5]  # one per message, in the partition of its key, in the order given
    assert ns.get_subscription_runtime_properties("t", "b").scheduled_message_count == 6

    sender.cancel_scheduled_messages([seqs[0], seqs[2]])  # m0 (partition 3) and m2 (partition 5)
    for sub, copies in (("a", 1), ("b", 2)):
        assert ids_in(ns, "t", sub) == Counter({"m1": copies}), sub
        assert ns.get_subscription_runtime_properties("t", sub).scheduled_message_count == copies
    sender.cancel_scheduled_messages(seqs)  # m0's and m2's numbers name nothing now (ignored, as for a queue); m1 goes
    assert ns.get_topic_runtime_properties("t").scheduled_message_count == 0


def test_cancelling_a_rescheduled_topic_message_keeps_its_replacement(ns: Namespace) -> None:
    """Schedule a replacement under the same id, then cancel the old number: only the old message goes."""
    ns.create_topic("t", enable_partitioning=False)  # one partition: the two messages are numbered side by side
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    sender = ns.get_topic_sender("t")
    when = datetime.now(UTC) + timedelta(minutes=5)
    (old,) = sender.schedule_messages(Message("v1", message_id="reminder-42"), when)
    (new,) = sender.schedule_messages(Message("v2", message_id="reminder-42"), when + timedelta(minutes=5))
    sender.cancel_scheduled_messages(old)
    for sub in ("a", "b"):
        with ns.get_subscription_receiver("t", sub) as r:
            assert [str(m) for m in peek_all(r)] == ["v2"], sub
    sender.cancel_scheduled_messages(new)
    assert ns.get_topic_runtime_properties("t").scheduled_message_count == 0


def test_a_topic_schedule_number_outlives_forwarded_copies(ns: Namespace) -> None:
    """The number of a scheduled topic message names a copy that stays (not one a forwarding subscription moved on)."""
    ns.create_queue("archive")
    ns.create_topic("t")
    ns.create_subscription("t", "a-forwarder", forward_to="archive")  # its copy leaves at once (scheduled ones too)
    ns.create_subscription("t", "b")
    sender = ns.get_topic_sender("t")
    (number,) = sender.schedule_messages(Message("x"), datetime.now(UTC) + timedelta(minutes=5))
    sender.cancel_scheduled_messages(number)
    assert ns.get_subscription_runtime_properties("t", "b").scheduled_message_count == 0
    assert ns.get_queue_runtime_properties("archive").scheduled_message_count == 1  # forwarded: no longer the topic's


def test_topic_schedule_numbers_unmatched_and_visible(ns: Namespace) -> None:
    """A message no subscription takes gets no number; cancelling a number of visible copies changes nothing."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    only_rule(ns, "t", "s", "n = 1")
    sender = ns.get_topic_sender("t")
    when = datetime.now(UTC) + timedelta(minutes=5)
    seqs = sender.schedule_messages(
        [Message("1", application_properties={"n": 1}), Message("2", application_properties={"n": 2})], when
    )
    assert len(seqs) == 1
    sent = sender.send_messages([Message("now", message_id="now", application_properties={"n": 1})])
    sender.cancel_scheduled_messages(sent)
    props = ns.get_subscription_runtime_properties("t", "s")
    assert (props.active_message_count, props.scheduled_message_count) == (1, 1)
    sender.cancel_scheduled_messages(seqs)
    assert ns.get_subscription_runtime_properties("t", "s").scheduled_message_count == 0
    assert ids_in(ns, "t", "s") == Counter({"now": 1})
