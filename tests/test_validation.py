"""Argument validation: every bad argument raises the documented error and nothing is stored or created
(docs/semantics.md §1, §2, §5, §11)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import drain, peek_all

from sparkqueue import AutoLockRenewer, Message, Namespace
from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, MessageLockLostError, SparkQueueError
from sparkqueue.model import limits


def _nothing_stored(ns: Namespace, queue: str = "q") -> None:
    assert ns.get_queue_runtime_properties(queue).total_message_count == 0
    with ns.get_queue_receiver(queue) as r:
        assert peek_all(r) == []


# ---- messages --------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [123, 1.5, ["a"], {"a": 1}, object()])
def test_body_must_be_bytes_or_str(body: object) -> None:
    """A body that is neither bytes, str nor None (the SDK allows None) raises InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        Message(body)  # type: ignore[arg-type]


@pytest.mark.parametrize("props", [["a", 1], "k=v", 42, ("a", 1)])
def test_application_properties_must_be_a_dict(props: object) -> None:
    """application_properties that are not a dict raise InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        Message("x", application_properties=props)  # type: ignore[arg-type]


@pytest.mark.parametrize("props", [{"k": [1, 2]}, {"k": {"nested": 1}}, {"k": object()}, {"k": {1, 2}}, {1: "int key"}])
def test_application_property_values_must_be_supported_types(props: dict[Any, Any]) -> None:
    """Application property values of unsupported types (and non-str names) raise InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        Message("x", application_properties=props)


@pytest.mark.parametrize("field", ["message_id", "session_id", "partition_key"])
@pytest.mark.parametrize("value", [42, b"bytes", 1.0])
def test_keys_must_be_strings(field: str, value: object) -> None:
    """message_id, session_id and partition_key must be str."""
    with pytest.raises(InvalidOperationError):
        Message("x", **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("body", 12),
        ("application_properties", {"a": object()}),
        ("application_properties", {"x": float("nan")}),
        ("content_type", b"text/plain"),
        ("subject", 5),
        ("to", ["a"]),
        ("reply_to", 1.0),
        ("reply_to_session_id", "\ud800"),
        ("time_to_live", -3),
        ("time_to_live", timedelta(seconds=-1)),
        ("scheduled_enqueue_time_utc", "tomorrow"),
        ("session_id", "s" * 129),
        ("message_id", ""),
    ],
)
def test_a_field_set_after_construction_is_checked_there(ns: Namespace, field: str, value: object) -> None:
    """A bad value assigned to a field later is refused at once, as in the constructor; the message stays sendable."""
    ns.create_queue("q")
    message = Message("x")
    with pytest.raises(InvalidOperationError):
        setattr(message, field, value)
    with ns.get_queue_sender("q") as s:
        s.send_messages(message)  # the refused assignment left the message as it was
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in drain(r, 1)] == ["x"]


@pytest.mark.parametrize("value", [object(), float("inf"), [1, 2]])
def test_application_properties_changed_in_place_are_checked_at_send(ns: Namespace, value: object) -> None:
    """A property added to the dict after it was assigned is checked when the message is sent: a clear error, nothing stored."""
    ns.create_queue("q")
    message = Message("x", application_properties={"ok": 1})
    message.application_properties["bad"] = value  # type: ignore[index]
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidOperationError):
        s.send_messages(message)
    _nothing_stored(ns)


def test_fields_assigned_later_are_stored_as_given(ns: Namespace) -> None:
    """Fields set after construction are converted as the constructor converts them (str body as UTF-8, naive times as UTC)."""
    ns.create_queue("q")
    message = Message(None)
    message.body = "héllo"
    message.subject, message.time_to_live = "greeting", timedelta(minutes=5)
    with ns.get_queue_sender("q") as s:
        s.send_messages(message)
    with ns.get_queue_receiver("q") as r:
        (got,) = drain(r, 1)
    assert (got.body, got.subject, got.time_to_live) == ("héllo".encode(), "greeting", timedelta(minutes=5))


@pytest.mark.parametrize("field", ["content_type", "correlation_id", "subject", "to", "reply_to", "reply_to_session_id"])
def test_string_properties_must_be_strings(field: str) -> None:
    """Broker string properties of another type raise InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        Message("x", **{field: 5})


@pytest.mark.parametrize("ttl", [5, "1h", timedelta(0), timedelta(seconds=-1), timedelta(microseconds=999)])
def test_time_to_live_must_be_a_positive_timedelta(ttl: object) -> None:
    """time_to_live must be a positive timedelta."""
    with pytest.raises(InvalidOperationError):
        Message("x", time_to_live=ttl)  # type: ignore[arg-type]


def test_scheduled_time_must_be_a_datetime() -> None:
    """scheduled_enqueue_time_utc must be a datetime."""
    with pytest.raises(InvalidOperationError):
        Message("x", scheduled_enqueue_time_utc="2030-01-01T00:00:00Z")  # type: ignore[arg-type]


def test_send_rejects_non_messages(ns: Namespace) -> None:
    """send_messages takes a Message (or dict of its fields), a list of them or a batch; anything else raises, storing nothing."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        for bad in ("text", b"bytes", 42, {"bogus": "x"}, [Message("ok"), b"raw"]):
            with pytest.raises(InvalidOperationError):
                s.send_messages(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOperationError):
            s.schedule_messages(Message("x"), "tomorrow")  # type: ignore[arg-type]
        with pytest.raises(InvalidOperationError):
            s.cancel_scheduled_messages([-1])
        with pytest.raises(InvalidOperationError):
            s.create_message_batch(max_size_in_bytes=limits.MAX_BATCH_BYTES + 1)
        with pytest.raises(InvalidOperationError):
            s.create_message_batch(max_size_in_bytes=0)
    _nothing_stored(ns)


def test_every_error_is_a_sparkqueue_error() -> None:
    """Validation errors derive from SparkQueueError (and InvalidOperationError from ValueError)."""
    with pytest.raises(SparkQueueError):
        Message(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Message("x", message_id="m" * 200)


# ---- queue settings --------------------------------------------------------------------------


BAD_SETTINGS: list[dict[str, Any]] = [
    {"lock_duration": 30},
    {"lock_duration": timedelta(minutes=5, seconds=1)},
    {"lock_duration": timedelta(0)},
    {"duplicate_detection_history_time_window": timedelta(seconds=19)},
    {"duplicate_detection_history_time_window": timedelta(days=7, seconds=1)},
    {"duplicate_detection_history_time_window": 600},
    {"max_size_in_megabytes": 1000},
    {"max_size_in_megabytes": 10240},
    {"max_size_in_megabytes": "1024"},
    {"max_size_in_megabytes": True},
    {"max_size_in_megabytes": 1024.0},
    {"max_delivery_count": 0},
    {"max_delivery_count": -3},
    {"max_delivery_count": 2.5},
    {"default_message_time_to_live": 60},
    {"default_message_time_to_live": timedelta(seconds=-5)},
    {"default_message_time_to_live": timedelta(microseconds=5)},  # kept in whole milliseconds: it would be 0
    {"enable_partitioning": "yes"},
    {"requires_session": 1},
    {"requires_duplicate_detection": None},
    {"dead_lettering_on_message_expiration": "false"},
    {"forward_to": "bad name!"},
    {"no_such_setting": 1},
]


@pytest.mark.parametrize("settings", BAD_SETTINGS, ids=lambda s: "-".join(f"{k}={v!r}" for k, v in s.items()))
def test_invalid_queue_settings_are_refused(ns: Namespace, settings: dict[str, Any]) -> None:
    """A setting of the wrong type or outside the contract's limits raises InvalidOperationError; no queue is created."""
    with pytest.raises(InvalidOperationError):
        ns.create_queue("q", **settings)
    assert ns.list_queues() == []


@pytest.mark.parametrize(
    "settings",
    [
        {"lock_duration": timedelta(minutes=5)},
        {"lock_duration": timedelta(seconds=1)},
        {"duplicate_detection_history_time_window": timedelta(seconds=20)},
        {"duplicate_detection_history_time_window": timedelta(days=7)},
        {"max_delivery_count": 1},
    ],
    ids=lambda s: "-".join(f"{k}={v!r}" for k, v in s.items()),
)
def test_settings_at_the_limits_are_accepted(ns: Namespace, settings: dict[str, Any]) -> None:
    """Settings exactly at the contract's limits are accepted and stored."""
    ns.create_queue("q", **settings)
    got = ns.get_queue("q")
    for k, v in settings.items():
        assert getattr(got, k) == v


BAD_NAMES: list[object] = [
    "",
    "a" * 261,
    "has space",
    "star*",
    "semi;colon",
    "hash#",
    "pipe|name",
    "-leading",
    "trailing-",
    ".dot",
    "a//b",
    "ünïcode",
    None,
    123,
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_invalid_queue_names_are_refused(ns: Namespace, name: object) -> None:
    """Bad queue names (empty, too long, illegal characters, leading '-') raise InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        ns.create_queue(name)  # type: ignore[arg-type]
    assert ns.list_queues() == []


UNENCODABLE = "q\udcff"  # what sys.argv and os.fsdecode make of the bytes b"q\xff"

LOOKUPS_BY_NAME: dict[str, Callable[[Namespace], Any]] = {
    "get_queue": lambda ns: ns.get_queue(UNENCODABLE),
    "delete_queue": lambda ns: ns.delete_queue(UNENCODABLE),
    "get_queue_runtime_properties": lambda ns: ns.get_queue_runtime_properties(UNENCODABLE),
    "get_topic": lambda ns: ns.get_topic(UNENCODABLE),
    "list_subscriptions": lambda ns: ns.list_subscriptions(UNENCODABLE),
    "get_subscription": lambda ns: ns.get_subscription("t", UNENCODABLE),
    "get_subscription_runtime_properties": lambda ns: ns.get_subscription_runtime_properties("t", UNENCODABLE),
    "delete_subscription": lambda ns: ns.delete_subscription("t", UNENCODABLE),
    "list_rules": lambda ns: ns.list_rules("t", UNENCODABLE),
    "get_rule": lambda ns: ns.get_rule("t", "s", UNENCODABLE),
    "delete_rule": lambda ns: ns.delete_rule("t", "s", UNENCODABLE),
    "create_subscription": lambda ns: ns.create_subscription(UNENCODABLE, "x"),
    "create_rule": lambda ns: ns.create_rule("t", UNENCODABLE, "r"),
    "get_queue_sender": lambda ns: ns.get_queue_sender(UNENCODABLE),
}


@pytest.mark.parametrize("call", LOOKUPS_BY_NAME.values(), ids=LOOKUPS_BY_NAME.keys())
def test_a_name_with_no_utf8_form_is_refused(ns: Namespace, call: Callable[[Namespace], Any]) -> None:
    """A name with lone surrogates names no entity (the catalog stores UTF-8): InvalidOperationError, not a raw TypeError."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError, match="no UTF-8 form"):
        call(ns)
    assert [x.name for x in ns.list_subscriptions("t")] == ["s"]
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


PIPED: dict[str, tuple[Callable[[Namespace], Any], str]] = {
    "get_queue": (lambda ns: ns.get_queue("q|x"), "queue name 'q|x'"),
    "get_subscription, subscription part": (lambda ns: ns.get_subscription("t", "s|x"), "subscription name 's|x'"),
    "get_subscription, topic part": (lambda ns: ns.get_subscription("t|s", "x"), "topic name 't|s'"),
    "get_rule": (lambda ns: ns.get_rule("t", "s", "$Default|x"), "rule name '[$]Default[|]x'"),
    "get_subscription_receiver": (lambda ns: ns.get_subscription_receiver("t", "s|x"), "subscription name 's|x'"),
    "get_topic_sender": (lambda ns: ns.get_topic_sender("t|s"), "topic name 't|s'"),
    "delete_subscription": (lambda ns: ns.delete_subscription("t", "s|x"), "subscription name 's|x'"),
    "create_queue": (lambda ns: ns.create_queue("q|x"), "queue name 'q|x'"),
    "create_rule": (lambda ns: ns.create_rule("t", "s", "r|x"), "rule name 'r|x'"),
}


@pytest.mark.parametrize("call, named", PIPED.values(), ids=PIPED.keys())
def test_a_name_holding_the_catalog_separator_is_refused_by_that_name(
    ns: Namespace, call: Callable[[Namespace], Any], named: str
) -> None:
    """The catalog joins a subscription's or rule's name parts with '|'. A lookup holding one raised
    EntityNotFoundError naming another path ("t/Subscriptions/s/Rules/x" for subscription "s|x"); every name given is
    refused as invalid, naming what was asked for, and nothing changes."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError, match=f"invalid {named}: names cannot contain '[|]'"):
        call(ns)
    assert [x.name for x in ns.list_subscriptions("t")] == ["s"]
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    assert ns.list_queues() == []


@pytest.mark.parametrize("name", ["a", "a" * 260, "orders.v2", "my_queue-1", "A1", "path/to/queue"])
def test_valid_queue_names_are_accepted(ns: Namespace, name: str) -> None:
    """Names of 1 to 260 letters, digits, '.', '-', '_' and '/' (alphanumeric at both ends) work end to end."""
    ns.create_queue(name)
    with ns.get_queue_sender(name) as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver(name) as r:
        assert [str(m) for m in drain(r, 1)] == ["x"]
    assert [q.name for q in ns.list_queues()] == [name]


def test_namespace_operation_timeout_must_be_positive(root: str) -> None:
    """operation_timeout must be a positive number."""
    for bad in (0, -1, "60", True):
        with pytest.raises(InvalidOperationError):
            Namespace(root, operation_timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["false", "no", 0, 1, None])
def test_namespace_create_must_be_a_bool_and_a_refused_one_makes_nothing(tmp_path: Path, flag: object) -> None:
    """Namespace(root, create="false") made the namespace: the flag was read by its truth. It must be a bool, and a
    refused one writes nothing at the root."""
    root = tmp_path / "ns"
    with pytest.raises(InvalidArgumentTypeError, match="create must be a bool"):
        Namespace(str(root), create=flag)  # type: ignore[arg-type]
    assert not root.exists()


@pytest.mark.parametrize("flag", ["false", 0, 1, None])
def test_check_repair_must_be_a_bool_and_a_refused_one_repairs_nothing(ns: Namespace, root: str, flag: object) -> None:
    """check(repair="false") repaired: a data file set aside to be put back lost its messages for good. The flag must be
    a bool; a refused one changes nothing, and the file put back serves its messages again."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(3)])
    (data,) = glob.glob(f"{root}/entities/queue-*/partition_id=*/*.parquet")
    os.rename(data, data + ".aside")
    with pytest.raises(InvalidArgumentTypeError, match="repair must be a bool"):
        ns.check(repair=flag)  # type: ignore[arg-type]
    assert [f.repaired for f in ns.check()] == [False]  # still found: nothing was repaired
    os.rename(data + ".aside", data)
    assert ns.check() == []
    assert ns.get_queue_runtime_properties("q").active_message_count == 3


def test_flag_and_storage_option_errors_name_what_is_wrong(root: str) -> None:
    """A numpy bool was refused as "must be a bool, got bool", and a storage option with a non-string key blamed its value."""
    np = pytest.importorskip("numpy")
    ns = Namespace(root)
    with pytest.raises(InvalidArgumentTypeError, match=r"got numpy\.bool"):
        ns.create_queue("q", enable_partitioning=np.bool_(True))
    with pytest.raises(InvalidOperationError, match="keys must be strings, got 1"):
        Namespace(root, storage_options={1: "x"})  # type: ignore[dict-item]


def test_a_property_named_twice_as_str_and_bytes_is_refused() -> None:
    """{b"k": 1, "k": 2} kept one of the two values without a word."""
    with pytest.raises(InvalidOperationError, match="given twice"):
        Message("x", application_properties={b"k": 1, "k": 2})


def test_settling_another_entitys_message_says_it_may_not_be_from_here(ns: Namespace) -> None:
    """Completing a message of queue q2 on a receiver of q1 is refused and changes nothing; the error said only that its
    lock expired or was taken, which sent users looking for a lock problem."""
    for q in ("q1", "q2"):
        ns.create_queue(q)
        with ns.get_queue_sender(q) as s:
            s.send_messages(Message(q))
    with ns.get_queue_receiver("q1") as r1, ns.get_queue_receiver("q2") as r2:
        (m2,) = drain(r2, 1)
        with pytest.raises(MessageLockLostError, match="not received from 'q1'"):
            r1.complete_message(m2)
        r2.complete_message(m2)
    assert [ns.get_queue_runtime_properties(q).active_message_count for q in ("q1", "q2")] == [1, 0]


# ---- receivers ---------------------------------------------------------------------------------


@pytest.fixture
def loaded(ns: Namespace) -> Namespace:
    """A namespace whose queue "q" holds three messages."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(3)])
    return ns


def _untouched(ns: Namespace) -> None:
    """All three messages are still there, unlocked and never delivered."""
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
    assert len(got) == 3
    assert {m.delivery_count for m in got} == {0}


@pytest.mark.parametrize("count", [0, -1, "3", 2.0, True])
def test_receive_rejects_bad_max_message_count(loaded: Namespace, count: object) -> None:
    """max_message_count must be a positive int; a bad one raises and locks nothing."""
    with loaded.get_queue_receiver("q") as r, pytest.raises(InvalidOperationError):
        r.receive_messages(max_message_count=count)  # type: ignore[arg-type]
    _untouched(loaded)


@pytest.mark.parametrize("wait", [-1, "5", timedelta(seconds=-1)])
def test_receive_rejects_bad_max_wait_time(loaded: Namespace, wait: object) -> None:
    """max_wait_time must be a non-negative number or timedelta."""
    with loaded.get_queue_receiver("q") as r, pytest.raises(InvalidOperationError):
        r.receive_messages(max_message_count=3, max_wait_time=wait)  # type: ignore[arg-type]
    with pytest.raises(InvalidOperationError):
        loaded.get_queue_receiver("q", max_wait_time=wait)  # type: ignore[arg-type]
    _untouched(loaded)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"receive_mode": "lock-it"},
        {"sub_queue": "poison"},
        {"prefetch_count": -1},
        {"prefetch_count": "10"},
        {"prefetch_count": 50_001},
        {"receive_mode": "receiveanddelete", "auto_lock_renewer": AutoLockRenewer()},
    ],
    ids=lambda kw: ", ".join(f"{k}={v!r}" if isinstance(v, (str, int)) else f"{k}={type(v).__name__}" for k, v in kw.items()),
)
def test_receiver_rejects_bad_options(loaded: Namespace, kwargs: dict[str, Any]) -> None:
    """Unknown receive modes or sub-queues, prefetch counts outside the SDK's 0-50,000 and a lock renewer for a
    receive-and-delete receiver (whose messages hold no lock; the SDK refuses it too) raise InvalidOperationError."""
    with pytest.raises(InvalidOperationError):
        loaded.get_queue_receiver("q", **kwargs)
    _untouched(loaded)


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.peek_messages(0),
        lambda r: r.peek_messages(5, sequence_number=-1),
        lambda r: r.receive_deferred_messages([-5]),
        lambda r: r.receive_deferred_messages(["1"]),
    ],
    ids=["peek-0", "peek-negative-seq", "deferred-negative", "deferred-str"],
)
def test_browse_and_deferred_calls_validate_arguments(loaded: Namespace, call: Callable[[Any], object]) -> None:
    """peek_messages and receive_deferred_messages validate counts and sequence numbers."""
    with loaded.get_queue_receiver("q") as r, pytest.raises(InvalidOperationError):
        call(r)
    _untouched(loaded)


def test_settle_rejects_non_messages_and_bad_reasons(loaded: Namespace) -> None:
    """Settling something that is not a ReceivedMessage, or dead-lettering with a non-str reason, raises; the lock holds."""
    with loaded.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
        with pytest.raises(InvalidOperationError):
            r.complete_message("not a message")  # type: ignore[arg-type]
        with pytest.raises(InvalidOperationError):
            r.complete_message(Message("sent, not received"))  # type: ignore[arg-type]
        with pytest.raises(InvalidOperationError):
            r.dead_letter_message(m, reason=42)  # type: ignore[arg-type]
        with pytest.raises(InvalidOperationError):
            r.dead_letter_message(m, reason="ok", error_description=b"bytes")  # type: ignore[arg-type]
        assert loaded.get_queue_runtime_properties("q").dead_letter_message_count == 0
        r.complete_message(m)
        with pytest.raises(MessageLockLostError):
            r.complete_message(m)
    assert loaded.get_queue_runtime_properties("q").total_message_count == 2


def test_a_negative_duration_is_shown_as_written(ns: Namespace) -> None:
    """Errors showed Python's form of a negative timedelta ("-1 day, 23:59:55" for -5 s)."""
    with pytest.raises(InvalidOperationError, match=r"must be positive, got -0:00:05$"):
        ns.create_queue("x", default_message_time_to_live=timedelta(seconds=-5))
    with pytest.raises(InvalidOperationError, match=r"must not be negative, got -5:00:00$"):
        ns.run_maintenance(vacuum_retention=timedelta(hours=-5))


def test_a_root_that_cannot_be_made_is_a_storage_error_naming_it(tmp_path) -> None:
    """delta-rs's own error (its classes live in the module `_internal`) escaped as a raw TableNotFoundError."""
    from sparkqueue.errors import StorageError

    with pytest.raises(StorageError, match=r"creating the catalog /proc/sparkqueue-nowhere/ns/_catalog failed"):
        Namespace("/proc/sparkqueue-nowhere/ns")
