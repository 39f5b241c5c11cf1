"""Hypothesis fuzz of the public API's inputs: each input either works or raises a clear error and stores nothing.

"Clear" means a sparkqueue.errors error, or the SDK's ValueError/TypeError; never OverflowError,
RecursionError, AttributeError or a storage error. What is accepted must read back and must not
break the namespace-wide jobs (listing, maintenance, forwarding, deletion).
"""

from __future__ import annotations

import contextlib
import math
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sparkqueue import Message, Namespace, SqlRuleAction, SqlRuleFilter  # noqa: E402
from sparkqueue.errors import SparkQueueError  # noqa: E402
from tests.procs import drain, peek_all  # noqa: E402

CLEAN = (SparkQueueError, ValueError, TypeError)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=20),
    st.uuids(),
    st.timedeltas(),
    st.datetimes(timezones=st.none() | st.just(UTC)),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
texts = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(["\n", "\x00", "\udc80", "é", "/"]), max_size=140)
durations = st.one_of(
    st.none(),
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(days=10_675_199), timedelta(0), "PT13S", "P10675199D", "bogus"]),
    st.floats(allow_nan=True),
)
times = st.one_of(
    st.none(), st.datetimes(timezones=st.none() | st.just(UTC)), st.sampled_from([datetime.max, datetime.min]), anything
)

message_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "message_id": st.one_of(texts, st.uuids(), anything),
        "session_id": st.one_of(texts, anything),
        "partition_key": st.one_of(texts, anything),
        "correlation_id": st.one_of(texts, st.uuids(), anything),
        "subject": st.one_of(texts, anything),
        "content_type": texts,
        "application_properties": st.one_of(
            anything,
            st.dictionaries(
                st.one_of(texts, st.binary(max_size=5)),
                st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts),
                max_size=4,
            ),
        ),
        "time_to_live": durations,
        "scheduled_enqueue_time_utc": times,
    },
)


def _check_roundtrip(ns: Namespace, sent: Message) -> None:
    # A message with a session id went to a session queue (see test_fuzz_message_send): read it through its session.
    # One with a time to live under a minute may expire before it is read back (docs/semantics.md §5): then it is gone.
    may_expire = sent.time_to_live is not None and sent.time_to_live < timedelta(minutes=1)
    # (A session id that is not a str, such as a UUID, becomes one; its queue was made without sessions.)
    session_id = sent.session_id if ns.get_queue("q").requires_session else None
    with ns.get_queue_receiver("q", session_id=session_id) as r:
        peeked = peek_all(r)
        if not peeked and may_expire:
            return
        assert len(peeked) == 1
        due = sent.scheduled_enqueue_time_utc is None or sent.scheduled_enqueue_time_utc <= datetime.now(UTC)
        received = drain(r, 1, timeout_s=2 if may_expire else 10) if due else [peeked[0]]
        if not received and may_expire:
            return
        (got,) = received
        assert got.body == sent.body
        if sent.message_id is not None:
            assert got.message_id == sent.message_id
        assert got.session_id == sent.session_id
        assert (got.application_properties or None) == (sent.application_properties or None)
        if got.lock_token is not None:
            r.complete_message(got)


@FUZZ
@given(body=st.one_of(st.none(), st.binary(max_size=50), texts, anything), kwargs=message_kwargs)
def test_fuzz_message_send(tmp_path_factory: pytest.TempPathFactory, body: Any, kwargs: dict[str, Any]) -> None:
    """Message(...) + send: either a clean error with nothing stored, or a message that reads back unchanged."""
    root: Path = tmp_path_factory.mktemp("fuzz")
    with Namespace(root / "ns") as ns:
        ns.create_queue("q", requires_session="session_id" in kwargs and isinstance(kwargs["session_id"], str))
        try:
            m = Message(body, **kwargs)
        except CLEAN:
            return
        try:
            with ns.get_queue_sender("q") as s:
                s.send_messages(m)
        except CLEAN:
            assert ns.get_queue_runtime_properties("q").total_message_count == 0
            return
        assert [q.name for q in ns.list_queues()] == ["q"]
        _check_roundtrip(ns, m)
        ns.run_maintenance(vacuum=False)


queue_settings = st.fixed_dictionaries(
    {},
    optional={
        "lock_duration": durations,
        "default_message_time_to_live": durations,
        "duplicate_detection_history_time_window": durations,
        "auto_delete_on_idle": durations,
        "max_delivery_count": st.one_of(st.integers(-5, 2**64), anything),
        "max_size_in_megabytes": st.one_of(st.sampled_from([1024, 5120, 81920]), anything),
        "requires_duplicate_detection": anything,
        "enable_partitioning": anything,
        "forward_to": st.one_of(texts, anything),
        "user_metadata": st.one_of(texts, anything),
        "status": st.one_of(st.sampled_from(["Active", "Disabled", "SendDisabled", "nope"]), anything),
    },
)


@FUZZ
@given(name=st.one_of(texts, anything), settings_=queue_settings)
def test_fuzz_create_queue(tmp_path_factory: pytest.TempPathFactory, name: Any, settings_: dict[str, Any]) -> None:
    """create_queue: a clean error creating nothing, or a queue every namespace-wide job can list, maintain and delete."""
    root: Path = tmp_path_factory.mktemp("fuzzq")
    with Namespace(root / "ns") as ns:
        try:
            ns.create_queue(name, **settings_)
        except CLEAN:
            assert ns.list_queues() == []
            return
        assert [q.name for q in ns.list_queues()] == [name]
        ns.get_queue_runtime_properties(name)
        status = str(ns.get_queue(name).status)
        if status == "Active":
            with ns.get_queue_sender(name) as s:
                s.send_messages([Message("a"), Message("b", time_to_live=timedelta(days=1))])
            with ns.get_queue_receiver(name) as r:
                got = drain(r, 2)
                for m in got:
                    r.complete_message(m)
        ns.run_maintenance(vacuum=False)
        ns.forward_pending_messages()
        ns.delete_queue(name)
        assert ns.list_queues() == []


sql_atoms = st.sampled_from(["a", "sys.Label", "user.x", "1", "1.5", "'s'", "@p", "NULL", "TRUE", "newid()", "sys.TimeToLive"])
sql_ops = st.sampled_from([" = ", " <> ", " + ", " * ", " / ", " % ", " AND ", " OR ", " LIKE ", " IN ", " IS ", "("])
sql_text = st.one_of(
    st.lists(
        st.one_of(sql_atoms, sql_ops, st.sampled_from(["NOT ", "-", ")", ",", ";", "SET x = ", "REMOVE x"])), max_size=60
    ).map("".join),
    st.integers(0, 2000).map(lambda n: "(" * n + "a = 1" + ")" * n),
    st.integers(0, 700).map(lambda n: " OR ".join(["a = 1"] * max(n, 1))),
    texts,
)


@FUZZ
@given(filter_text=sql_text, action_text=st.one_of(st.none(), sql_text), param=anything)
def test_fuzz_rules(tmp_path_factory: pytest.TempPathFactory, filter_text: str, action_text: str | None, param: Any) -> None:
    """Any rule text: refused at construction/create_rule, or fan-out delivers to every other subscription regardless."""
    root: Path = tmp_path_factory.mktemp("fuzzr")
    with Namespace(root / "ns") as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "healthy")
        ns.create_subscription("t", "fuzzed")
        try:
            flt = SqlRuleFilter(filter_text, {"p": param})
            action = SqlRuleAction(action_text, {"p": param}) if action_text is not None else None
            ns.create_rule("t", "fuzzed", "r", filter=flt, action=action)
        except CLEAN:
            assert [r.name for r in ns.list_rules("t", "fuzzed")] == ["$Default"]
        with ns.get_topic_sender("t") as s:
            s.send_messages([Message("m", application_properties={"a": 1, "x": 2}), Message("n", subject="s")])
        with ns.get_subscription_receiver("t", "healthy") as r:
            assert sorted(str(m) for m in drain(r, 2)) == ["m", "n"]
        ns.run_maintenance(vacuum=False)


def _bounded(wait: Any) -> Any:
    """A wait the receive may accept, shortened to 10 ms (a valid one would otherwise block the test); others as they are."""
    if isinstance(wait, timedelta):
        return timedelta(milliseconds=10) if wait > timedelta(0) else wait
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and math.isfinite(wait) and wait > 0:
        return 0.01
    return wait


@FUZZ
@given(
    count=st.one_of(st.integers(-(2**70), 2**70), anything),
    seq=st.one_of(st.integers(-(2**70), 2**70), anything),
    wait=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 2**70), anything),
)
def test_fuzz_receiver_arguments(tmp_path_factory: pytest.TempPathFactory, count: Any, seq: Any, wait: Any) -> None:
    """Counts, sequence numbers and waits: a clean error, or a bounded call (the message is never lost)."""
    root: Path = tmp_path_factory.mktemp("fuzzrcv")
    with Namespace(root / "ns") as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("x", message_id=str(uuid.uuid4())))
        with ns.get_queue_receiver("q", receive_mode="receiveanddelete") as r:
            for call in (
                lambda: r.peek_messages(count),
                lambda: r.peek_messages(1, sequence_number=seq),
                lambda: r.receive_deferred_messages(seq),
                lambda: r.receive_messages(
                    max_message_count=count,
                    max_wait_time=wait if isinstance(wait, float) and math.isfinite(wait) and wait < 0.2 else None,
                ),
                lambda: r.receive_messages(max_message_count=1, max_wait_time=_bounded(wait)),
            ):
                with contextlib.suppress(CLEAN):
                    call()
        assert ns.get_queue_runtime_properties("q").total_message_count in (0, 1)
