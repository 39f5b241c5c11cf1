"""Hostile input at the public API (issue #13: rules, overflow, action limits, names).

Every value sparkqueue accepts must be one it can store and compute with; everything else raises a
clear sparkqueue.errors error (or the SDK's ValueError/TypeError) and stores nothing. A topic's
fan-out never raises for one subscription's rule, and no accepted value breaks namespace-wide jobs.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from sparkqueue import Message, Namespace, SqlRuleAction, SqlRuleFilter, SubQueue
from sparkqueue.errors import FilterSyntaxError, MessageSizeExceededError, SparkQueueError
from sparkqueue.model.topics import RULE_ACTION_REASON
from tests.procs import drain, drain_all, peek_all

CLEAN = (SparkQueueError, ValueError, TypeError)


def _total(ns: Namespace, queue: str = "q") -> int:
    return ns.get_queue_runtime_properties(queue).total_message_count


# ---- 1. rules can never stop a topic --------------------------------------------------------------


def test_huge_or_deep_rules_are_refused_at_create_and_the_topic_keeps_working(ns: Namespace) -> None:
    """600 ORs, 123 nested parentheses, 200 NOTs, a 1,000-term sum: FilterSyntaxError at create_rule, not RecursionError."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    bad = [
        " OR ".join(["a = 1"] * 600),
        "(" * 123 + "a = 1" + ")" * 123,
        "NOT " * 200 + "a = 1",
        "-" * 300 + "a = 1",
        "a = " + "+".join(["1"] * 400),
    ]
    for text in bad:
        with pytest.raises(FilterSyntaxError):
            ns.create_rule("t", "s", "r", filter=SqlRuleFilter(text))
        with pytest.raises(FilterSyntaxError):
            SqlRuleAction(f"SET x = {text}")
    with pytest.raises(FilterSyntaxError):
        SqlRuleAction("; ".join(f"SET p{i} = 1" for i in range(33)))
    # The longest chain Service Bus's 1,024 characters allow is fine (built balanced), and fan-out works.
    longest = " OR ".join(["a = 1"] * 113)
    ns.create_rule("t", "s", "long", filter=SqlRuleFilter(longest))
    ns.create_rule("t", "s", "nested", filter=SqlRuleFilter("(" * 30 + "a = 2" + ")" * 30))
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("x", application_properties={"a": 1}), Message("y", application_properties={"a": 2})])
    with ns.get_subscription_receiver("t", "s") as r:
        assert sorted(str(m) for m in drain(r, 2)) == ["x", "y"]
    assert [rule.name for rule in ns.list_rules("t", "s")] == ["$Default", "long", "nested"]
    ns.run_maintenance()
    ns.forward_pending_messages()


def test_many_correlation_properties_stay_shallow(ns: Namespace) -> None:
    """A CorrelationRuleFilter with thousands of properties evaluates without recursion trouble."""
    from sparkqueue import CorrelationRuleFilter

    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.delete_rule("t", "s", "$Default")
    props = {f"p{i}": i for i in range(3000)}
    ns.create_rule("t", "s", "c", filter=CorrelationRuleFilter(properties=props))
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("hit", application_properties=props), Message("miss")])
    with ns.get_subscription_receiver("t", "s") as r:
        assert [str(m) for m in drain_all(r)] == ["hit"]


# ---- 2. TTL, time and count overflow ---------------------------------------------------------------

INFINITE_TTLS = [timedelta.max, timedelta(days=10_675_199), timedelta(days=10_675_199, hours=2, minutes=48, seconds=5.4775807)]


@pytest.mark.parametrize("ttl", INFINITE_TTLS, ids=["timedelta.max", "10675199 days", "TimeSpan.MaxValue"])
def test_infinite_ttls_mean_never_and_break_nothing(ns: Namespace, ttl: timedelta) -> None:
    """Service Bus's "infinite" TTL (and timedelta.max) is never-expires on entities and messages; every job still works."""
    ns.create_queue("p", default_message_time_to_live=ttl)
    ns.create_topic("t", default_message_time_to_live=ttl)
    ns.create_subscription("t", "s", default_message_time_to_live=ttl)
    assert ns.get_queue("p").default_message_time_to_live is None
    with ns.get_queue_sender("p") as s:
        s.send_messages([Message("a", time_to_live=ttl), Message("b")])
        s.schedule_messages(Message("late", time_to_live=timedelta(days=3_000_000)), datetime.max)
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("c", time_to_live=ttl))
    assert [q.name for q in ns.list_queues()] == ["p"]
    ns.run_maintenance()
    ns.forward_pending_messages()
    with ns.get_queue_receiver("p") as r:
        peeked = peek_all(r)
        assert len(peeked) == 3 and all(m.expires_at_utc is None for m in peeked)
        got = drain(r, 2)
        assert sorted(str(m) for m in got) == ["a", "b"] and all(m.time_to_live is None for m in got)
    with ns.get_subscription_receiver("t", "s") as r:
        assert [m.expires_at_utc for m in drain(r, 1)] == [None]
    ns.delete_queue("p")
    ns.delete_topic("t")
    assert ns.list_queues() == [] and ns.list_topics() == []


def test_counts_sequence_numbers_and_waits_are_bounded(ns: Namespace) -> None:
    """Values outside int64 and non-finite waits raise clear errors; nothing is received or changed."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
        for seqs in ([2**63], [2**64], -1, [1.5], "1"):
            with pytest.raises(CLEAN):
                s.cancel_scheduled_messages(seqs)  # type: ignore[arg-type]
    with ns.get_queue_receiver("q") as r:
        for n in (2**63, 2**64, 0, -1, 1.0, True):
            with pytest.raises(CLEAN):
                r.receive_messages(max_message_count=n)  # type: ignore[arg-type]
            with pytest.raises(CLEAN):
                r.peek_messages(n)  # type: ignore[arg-type]
        for seqs in ([2**64], [2**63], [-1], 2**70):
            with pytest.raises(CLEAN):
                r.receive_deferred_messages(seqs)
        for seq in (2**64, 2**63, -1):
            with pytest.raises(CLEAN):
                r.peek_messages(1, sequence_number=seq)
        for wait in (math.nan, math.inf, -math.inf, 1e300):
            with pytest.raises(ValueError):
                r.receive_messages(max_wait_time=wait)
        assert len(r.receive_messages(max_message_count=2**63 - 1)) == 1  # the largest count is accepted
    for wait in (math.nan, math.inf):
        with pytest.raises(ValueError):
            ns.get_queue_receiver("q", max_wait_time=wait)
    for timeout in (math.nan, math.inf, 0, -1, True):
        with pytest.raises(CLEAN):
            Namespace(ns.root, operation_timeout=timeout)
    for bad_time in (datetime.max.replace(tzinfo=timezone(timedelta(hours=-5))), "2030-01-01", 1e308):
        with ns.get_queue_sender("q") as s, pytest.raises(CLEAN):
            s.schedule_messages(Message("x"), bad_time)  # type: ignore[arg-type]
    assert _total(ns) == 1  # only the one message sent before the refused calls


# ---- 6. limits rule actions and settlements cannot bypass ------------------------------------------


def test_rule_actions_cannot_break_message_invariants(ns: Namespace) -> None:
    """A copy an action would make too large, with a long id, a bad TTL or a NaN is dead-lettered unmodified; others flow."""
    ns.create_topic("t")
    actions = {
        # two 256,000-character properties: each join stays within a message, the copy does not
        "big": SqlRuleAction("SET big = @p; " + "SET big = big + big; " * 8 + "SET big2 = big", {"p": "x" * 1000}),
        "longid": SqlRuleAction("SET sys.MessageId = @p", {"p": "i" * 1000}),
        "ttl": SqlRuleAction("SET sys.TimeToLive = -1000"),
        "nan": SqlRuleAction("SET x = 1.0 / 0"),
        "ok": SqlRuleAction("SET sys.TimeToLive = 60000; SET tag = 'ok'"),
    }
    for name, action in actions.items():
        ns.create_subscription("t", name)
        ns.delete_rule("t", name, "$Default")
        ns.create_rule("t", name, "r", filter=SqlRuleFilter("1=1"), action=action)
    ns.create_subscription("t", "healthy")
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("hello", message_id="m"))
    for name in ("big", "longid", "ttl", "nan"):
        assert ns.get_subscription_runtime_properties("t", name).active_message_count == 0
        with ns.get_subscription_receiver("t", name, sub_queue=SubQueue.DEAD_LETTER) as dlq:
            (dead,) = drain(dlq, 1)
        assert dead.dead_letter_reason == RULE_ACTION_REASON and dead.dead_letter_error_description
        assert (dead.message_id, str(dead), dead.size_in_bytes) == ("m", "hello", 6)
        assert dead.application_properties is not None and "big" not in dead.application_properties
    with ns.get_subscription_receiver("t", "ok") as r:
        (m,) = drain(r, 1)
    assert m.application_properties["tag"] == "ok" and m.time_to_live == timedelta(seconds=60)
    assert m.expires_at_utc == m.enqueued_time_utc + timedelta(seconds=60)
    assert m.application_properties == {"tag": "ok", "RuleName": "r"}  # the rule's name on its action's copy
    assert m.size_in_bytes == len(b"hello") + len(b"m") + len(b'{"tag": "ok", "RuleName": "r"}')
    with ns.get_subscription_receiver("t", "healthy") as r:
        assert [str(x) for x in drain(r, 1)] == ["hello"]


def test_settlement_and_state_limits(ns: Namespace) -> None:
    """Dead-letter texts over 4,096 characters, oversized session state and NaN properties are refused; nothing changes."""
    ns.create_queue("q")
    ns.create_queue("sq", requires_session=True)
    for value in (math.nan, math.inf, -math.inf, 2**64):
        with pytest.raises(CLEAN):
            Message("x", application_properties={"v": value})
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
        with pytest.raises(ValueError):
            r.dead_letter_message(m, reason="r" * 4097)
        with pytest.raises(ValueError):
            r.dead_letter_message(m, error_description="d" * (1024 * 1024))
        r.dead_letter_message(m, reason="r" * 4096, error_description="d" * 4096)
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("y", session_id="s"))
    with ns.get_queue_receiver("sq", session_id="s") as r:
        assert r.session is not None
        with pytest.raises(MessageSizeExceededError):
            r.session.set_state(b"s" * (5 * 1024 * 1024))
        assert r.session.get_state() is None
        r.session.set_state(b"s" * (256 * 1024))


# ---- 7. names ------------------------------------------------------------------------------------


NEWLINE_NAMES = ["abc\n", "abc\r\n", "\nabc", "a\nb"]


@pytest.mark.parametrize("name", NEWLINE_NAMES, ids=repr)
def test_names_with_newlines_are_refused_everywhere(ns: Namespace, name: str) -> None:
    """Queue, topic, subscription, rule and forward_to names may not end in (or hold) a newline."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    for call in (
        lambda: ns.create_queue(name),
        lambda: ns.create_topic(name),
        lambda: ns.create_subscription("t", name),
        lambda: ns.create_rule("t", "s", name),
        lambda: ns.create_queue("q", forward_to=name),
        lambda: ns.create_queue("q", forward_dead_lettered_messages_to=name),
        lambda: ns.create_subscription("t", "s2", forward_to=name),
    ):
        with pytest.raises(ValueError):
            call()
    assert ns.list_queues() == [] and [t.name for t in ns.list_topics()] == ["t"]
    assert [s.name for s in ns.list_subscriptions("t")] == ["s"]
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


@pytest.mark.parametrize("bad", [None, 42, b"q", ["q"], ""], ids=repr)
def test_non_string_names_raise_clear_errors(ns: Namespace, bad: Any) -> None:
    """None, non-str and empty names raise TypeError/ValueError (not AttributeError) on every lookup."""
    ns.create_queue("q")
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    calls = [
        lambda: ns.get_queue_sender(bad),
        lambda: ns.get_topic_sender(bad),
        lambda: ns.get_queue_receiver(bad),
        lambda: ns.get_subscription_receiver("t", bad),
        lambda: ns.get_subscription_receiver(bad, "s"),
        lambda: ns.get_queue(bad),
        lambda: ns.delete_queue(bad),
        lambda: ns.delete_topic(bad),
        lambda: ns.get_subscription("t", bad),
        lambda: ns.delete_subscription("t", bad),
        lambda: ns.get_rule("t", "s", bad),
        lambda: ns.create_queue(bad),
        lambda: ns.get_queue_runtime_properties(bad),
        lambda: ns.list_subscriptions(bad),
    ]
    for call in calls:
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        assert isinstance(info.value, SparkQueueError)
    assert [q.name for q in ns.list_queues()] == ["q"]


# ---- 5. values from pandas, mutated messages, statuses (review of 2026-11-26) ----------------------


def test_pandas_durations_and_times_are_taken_to_the_microsecond_or_refused(ns: Namespace) -> None:
    """A 1 ns Timedelta passed 'positive' and was stored as 0 (every message then expired); NaT broke the send."""
    pd = pytest.importorskip("pandas")
    for field in ("default_message_time_to_live", "duplicate_detection_history_time_window"):
        with pytest.raises(SparkQueueError, match=r"positive|at least"):
            ns.create_queue(f"q-{field[:7]}", **{field: pd.Timedelta(1, "ns")})
    with pytest.raises(SparkQueueError, match="point in time"):
        Message("x", scheduled_enqueue_time_utc=pd.NaT)
    ns.create_queue("q", default_message_time_to_live=pd.Timedelta(minutes=5))
    assert ns.get_queue("q").default_message_time_to_live == timedelta(minutes=5)
    with ns.get_queue_sender("q") as s:
        with pytest.raises(SparkQueueError, match="point in time"):
            s.schedule_messages(Message("x"), pd.NaT)
        with pytest.raises(TypeError, match="schedule_time_utc"):
            s.schedule_messages(Message("x"), None)  # type: ignore[arg-type]
        (seq,) = s.schedule_messages(Message("x"), pd.Timestamp("2100-01-01 00:00:00.000000999", tz="UTC"))
    with ns.get_queue_receiver("q") as r:
        (m,) = peek_all(r)
    assert m.sequence_number == seq and m.scheduled_enqueue_time_utc == datetime(2100, 1, 1, tzinfo=UTC)
    assert _total(ns) == 1


def test_a_lock_duration_under_a_second_is_refused(ns: Namespace) -> None:
    """Every settle of such a lock lost it: each message ended dead-lettered after max_delivery_count deliveries."""
    for bad in (timedelta(microseconds=1), timedelta(milliseconds=999)):
        with pytest.raises(SparkQueueError, match="at least"):
            ns.create_queue("q", lock_duration=bad)
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    with pytest.raises(SparkQueueError, match="at least"):
        ns.update_queue(ns.get_queue("q"), lock_duration=timedelta(milliseconds=100))
    assert ns.get_queue("q").lock_duration == timedelta(seconds=1)


@pytest.mark.parametrize("status", ["Creating", "Deleting", "Renaming", "Restoring", "Unknown"])
def test_a_status_only_the_service_reports_cannot_be_set(ns: Namespace, status: str) -> None:
    from sparkqueue.management import EntityStatus

    with pytest.raises(SparkQueueError, match="cannot be set"):
        ns.create_queue("q", status=EntityStatus(status))
    ns.create_queue("q")
    with pytest.raises(SparkQueueError, match="cannot be set"):
        ns.update_queue(ns.get_queue("q"), status=EntityStatus(status))
    assert ns.get_queue("q").status == "Active"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sequence_number", 2**70),
        ("sequence_number", "1"),
        ("sequence_number", None),
        ("lock_token", 123),
        ("lock_token", "\udc80"),
    ],
)
def test_settling_a_message_whose_fields_were_changed_is_a_clean_error_and_keeps_the_lock(
    ns: Namespace, field: str, value: object
) -> None:
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        (m,) = r.receive_messages(1)
        forged = __import__("copy").copy(m)
        object.__setattr__(forged, field, value)
        for settle in (r.complete_message, r.renew_message_lock, r.abandon_message):
            with pytest.raises(CLEAN, match=field):
                settle(forged)
        r.complete_message(m)  # the real one still holds its lock
    assert _total(ns) == 0


def test_list_queue_sessions_checks_its_name(ns: Namespace) -> None:
    for bad in (None, 5, b"q", ["q"]):
        with pytest.raises(TypeError, match="queue name must be a str"):
            ns.list_queue_sessions(bad)  # type: ignore[arg-type]


def test_non_ascii_application_properties_count_their_utf8_size(ns: Namespace) -> None:
    """Sizes counted the \\u-escaped JSON: 120 KB of emoji as a property was refused as 360 KB (the limit is 256 KB)."""
    ns.create_queue("q")
    text = "\U0001f600" * 30_000  # 120,000 bytes of UTF-8
    m = Message("", application_properties={"p": text})
    assert m.size_in_bytes < 121_000
    with ns.get_queue_sender("q") as s:
        s.send_messages(m)
    with ns.get_queue_receiver("q") as r:
        (got,) = drain(r, 1)
    assert got.application_properties == {"p": text}
