"""Queue management: create, get, update, delete, list, runtime properties, availability, the
namespace's lifecycle and tiers (docs/semantics.md §1, §10, §11)."""

from __future__ import annotations

import dataclasses
import glob
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import drain, drain_all, key_for_partition

from sparkqueue import Message, Namespace, SqlRuleFilter, management
from sparkqueue.broker import sub_entity_name
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    InvalidArgumentTypeError,
    InvalidOperationError,
    PartitionUnavailableError,
    QuotaExceededError,
    StorageCorruptedError,
)
from sparkqueue.model.properties import RuleProperties

CUSTOM = {
    "enable_partitioning": False,
    "max_size_in_megabytes": 2048,
    "requires_duplicate_detection": True,
    "duplicate_detection_history_time_window": timedelta(minutes=30),
    "requires_session": True,
    "lock_duration": timedelta(seconds=45),
    "max_delivery_count": 7,
    "default_message_time_to_live": timedelta(days=3),
    "dead_lettering_on_message_expiration": True,
}

DEFAULTS = {
    "enable_partitioning": True,
    "max_size_in_megabytes": 1024,
    "requires_duplicate_detection": False,
    "duplicate_detection_history_time_window": timedelta(minutes=10),
    "requires_session": False,
    "lock_duration": timedelta(seconds=60),
    "max_delivery_count": 10,
    "default_message_time_to_live": None,
    "dead_lettering_on_message_expiration": False,
    "forward_to": None,
    "forward_dead_lettered_messages_to": None,
}


# ---- create, get, list, delete ---------------------------------------------------------------


def test_create_queue_with_defaults(ns: Namespace) -> None:
    """A queue created without settings has the contract's defaults, and get_queue returns them with its name."""
    created = ns.create_queue("orders")
    got = ns.get_queue("orders")
    assert created.name == got.name == "orders"
    for name, value in DEFAULTS.items():
        assert getattr(got, name) == value, name
    assert len(ns.get_queue_runtime_properties("orders").partitions) == 16


def test_settings_round_trip(ns: Namespace) -> None:
    """Every setting given at creation is returned by get_queue unchanged."""
    ns.create_queue("q", **CUSTOM)
    got = ns.get_queue("q")
    for name, value in CUSTOM.items():
        assert getattr(got, name) == value, name


def test_forwarding_settings_round_trip(ns: Namespace) -> None:
    """forward_to and forward_dead_lettered_messages_to are kept as given."""
    ns.create_queue("dest")
    ns.create_queue("q", forward_to="dest", forward_dead_lettered_messages_to="dest")
    got = ns.get_queue("q")
    assert (got.forward_to, got.forward_dead_lettered_messages_to) == ("dest", "dest")


def test_list_queues(ns: Namespace) -> None:
    """list_queues returns every queue (sorted by name); deleted ones disappear."""
    assert ns.list_queues() == []
    for name in ("b", "a", "c"):
        ns.create_queue(name)
    assert [q.name for q in ns.list_queues()] == ["a", "b", "c"]
    ns.delete_queue("b")
    assert [q.name for q in ns.list_queues()] == ["a", "c"]


def test_a_queue_whose_log_is_torn_is_listed_as_unknown_and_the_others_counted(ns: Namespace, root: str) -> None:
    """One queue's torn newest log entry made list_queues_runtime_properties() (and `sparkqueue list`) fail for every
    queue. That queue is listed with availability "Unknown" and no count; alone, its runtime properties still raise."""
    for name in ("bad", "good"):
        ns.create_queue(name)
        with ns.get_queue_sender(name) as s:
            s.send_messages([Message("x"), Message("y")])
    bad_log = ns.broker.entity("queue", "bad").table.uri + "/_delta_log"
    ns.close()
    newest = sorted(glob.glob(bad_log + "/*.json"))[-1]
    data = Path(newest).read_bytes()
    Path(newest).write_bytes(data[: len(data) // 2])
    with Namespace(root, create=False) as again:
        listed = {p.name: p for p in again.list_queues_runtime_properties()}
        assert (listed["good"].availability_status, listed["good"].active_message_count) == ("Available", 2)
        assert listed["bad"].availability_status == "Unknown"
        assert not any(p.available for p in listed["bad"].partitions)
        with pytest.raises(StorageCorruptedError):
            again.get_queue_runtime_properties("bad")


def test_an_entity_whose_table_is_gone_while_the_catalog_names_it_is_damage_not_deleted(ns: Namespace) -> None:
    """The queue's directory removed by hand: receives and sends said the entity "was deleted" (EntityNotFoundError),
    while get_queue and create_queue still found it. Damaged storage is reported as such."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    shutil.rmtree(ns.broker.entity("queue", "q").table.uri)
    with Namespace(ns.root, create=False) as fresh:  # another process, which never read the table
        with pytest.raises(StorageCorruptedError, match="catalog names it"):
            fresh.get_queue_runtime_properties("q")
        with fresh.get_queue_sender("q") as s, pytest.raises(StorageCorruptedError, match="catalog names it"):
            s.send_messages(Message("y"))
        fresh.delete_queue("q")  # the name is free again
        fresh.create_queue("q")


def test_queue_and_topic_names_share_one_case_insensitive_space(ns: Namespace) -> None:
    """As in Service Bus: a queue cannot take a topic's name (in any case), nor a name with a subscription's path segment."""
    ns.create_topic("tp")
    ns.create_subscription("tp", "all")
    for create in (lambda: ns.create_queue("tp"), lambda: ns.create_queue("TP"), lambda: ns.create_topic("Tp")):
        with pytest.raises(EntityAlreadyExistsError, match="topic 'tp' exists"):
            create()
    for name in ("tp/Subscriptions/all", "a/rules/b", "x/subscriptions"):
        with pytest.raises(InvalidOperationError, match="reserved"):
            ns.create_queue(name)
    assert ns.list_queues() == [] and [t.name for t in ns.list_topics()] == ["tp"]
    ns.create_queue("Subscriptions")  # reserved only after a '/'
    with pytest.raises(EntityAlreadyExistsError, match="queue 'Subscriptions' exists"):
        ns.create_topic("subscriptions")


def test_create_existing_queue_fails_and_keeps_settings(ns: Namespace) -> None:
    """Creating a queue whose name is taken raises EntityAlreadyExistsError and leaves the existing one as it was."""
    ns.create_queue("q", max_delivery_count=3)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("kept"))
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_queue("q", max_delivery_count=9)
    assert ns.get_queue("q").max_delivery_count == 3
    assert len(ns.list_queues()) == 1
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in drain(r, 1)] == ["kept"]


def test_delete_queue_removes_it_and_its_messages(ns: Namespace) -> None:
    """A deleted queue is gone with its messages: a new queue of the same name starts empty."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(5)])
    ns.delete_queue("q")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue("q")
    ns.create_queue("q")
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    with ns.get_queue_receiver("q") as r:
        assert drain_all(r) == []


def test_unknown_queue_raises_entity_not_found(ns: Namespace) -> None:
    """get, delete, runtime properties, sender and receiver of an unknown queue raise EntityNotFoundError."""
    with pytest.raises(EntityNotFoundError):
        ns.get_queue("missing")
    with pytest.raises(EntityNotFoundError):
        ns.delete_queue("missing")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue_runtime_properties("missing")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue_sender("missing")
    with pytest.raises(EntityNotFoundError):
        ns.get_queue_receiver("missing")
    assert ns.list_queues() == []


def test_update_of_deleted_queue_raises_entity_not_found(ns: Namespace) -> None:
    """update_queue with the properties of a queue that was deleted raises EntityNotFoundError."""
    ns.create_queue("q")
    props = ns.get_queue("q")
    ns.delete_queue("q")
    props.max_delivery_count = 5
    with pytest.raises(EntityNotFoundError):
        ns.update_queue(props)
    assert ns.list_queues() == []


def test_sender_of_deleted_queue_fails(ns: Namespace) -> None:
    """Sending through a sender whose queue was deleted (by another namespace handle) raises EntityNotFoundError."""
    ns.create_queue("q")
    sender = ns.get_queue_sender("q")
    with Namespace(ns.root) as other:
        other.delete_queue("q")
    ns.broker.close()  # drop cached settings (not the handlers) so the deletion is seen at once
    with pytest.raises(EntityNotFoundError):
        sender.send_messages(Message("x"))


# ---- update ----------------------------------------------------------------------------------


def test_update_queue_changes_settings_and_behaviour(ns: Namespace) -> None:
    """update_queue applies changed settings; the next delivery uses the new lock_duration."""
    ns.create_queue("q")
    props = ns.get_queue("q")
    props.lock_duration = timedelta(seconds=5)
    props.max_delivery_count = 4
    props.default_message_time_to_live = timedelta(hours=2)
    ns.update_queue(props)
    got = ns.get_queue("q")
    assert (got.lock_duration, got.max_delivery_count, got.default_message_time_to_live) == (
        timedelta(seconds=5),
        4,
        timedelta(hours=2),
    )
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x"))
    with ns.get_queue_receiver("q") as r:
        before = datetime.now(UTC)
        (m,) = drain(r, 1)
        after = datetime.now(UTC)
    assert m.locked_until_utc is not None
    assert before + timedelta(seconds=5) <= m.locked_until_utc <= after + timedelta(seconds=5)
    assert m.expires_at_utc == m.enqueued_time_utc + timedelta(hours=2)


def test_update_is_seen_by_another_namespace_handle(ns: Namespace) -> None:
    """Settings updated through one Namespace object are read by another one opened on the same root."""
    ns.create_queue("q")
    props = ns.get_queue("q")
    props.max_delivery_count = 2
    ns.update_queue(props)
    with Namespace(ns.root) as other:
        assert other.get_queue("q").max_delivery_count == 2


@pytest.mark.parametrize(
    ("field", "value"), [("enable_partitioning", False), ("requires_session", True), ("requires_duplicate_detection", True)]
)
def test_update_cannot_change_settings_fixed_at_creation(ns: Namespace, field: str, value: bool) -> None:
    """An update changing partitioning, sessions or duplicate detection raises InvalidOperationError and changes nothing."""
    ns.create_queue("q")
    props = ns.get_queue("q")
    setattr(props, field, value)
    props.max_delivery_count = 3
    with pytest.raises(InvalidOperationError):
        ns.update_queue(props)
    got = ns.get_queue("q")
    assert getattr(got, field) == (not value)
    assert got.max_delivery_count == 10


def test_update_with_invalid_setting_fails(ns: Namespace) -> None:
    """An update with a setting outside the limits raises InvalidOperationError and changes nothing."""
    ns.create_queue("q")
    props = ns.get_queue("q")
    props.lock_duration = timedelta(minutes=10)
    with pytest.raises(InvalidOperationError):
        ns.update_queue(props)
    assert ns.get_queue("q").lock_duration == timedelta(seconds=60)


# ---- runtime properties ----------------------------------------------------------------------


def test_runtime_properties_count_without_overlap(ns: Namespace) -> None:
    """active, deferred, scheduled and dead-letter counts are disjoint and add up to the total."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", partition_key=f"k{i}") for i in range(6)])
        s.schedule_messages([Message("s1"), Message("s2")], datetime.now(UTC) + timedelta(minutes=10))
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 3)
        r.defer_message(got[0])
        r.dead_letter_message(got[1], reason="r")
        # got[2] stays locked: a locked message is still active
        rp = ns.get_queue_runtime_properties("q")
    assert rp.name == "q"
    assert rp.active_message_count == 4
    assert rp.deferred_message_count == 1
    assert rp.dead_letter_message_count == 1
    assert rp.scheduled_message_count == 2
    assert rp.total_message_count == 8
    assert rp.transfer_message_count == 0
    assert rp.transfer_dead_letter_message_count == 0
    assert rp.availability_status == "Available"


def test_runtime_properties_per_partition(ns: Namespace) -> None:
    """Runtime properties list 16 partitions whose counts add up to the totals."""
    ns.create_queue("q")
    placed = {3: 2, 9: 1, 14: 4}
    with ns.get_queue_sender("q") as s:
        for p, n in placed.items():
            s.send_messages([Message(f"{p}-{i}", partition_key=key_for_partition(p, "rt")) for i in range(n)])
    rp = ns.get_queue_runtime_properties("q")
    assert [p.partition_id for p in rp.partitions] == list(range(16))
    assert {p.partition_id: p.active_message_count for p in rp.partitions if p.active_message_count} == placed
    assert sum(p.total_message_count for p in rp.partitions) == rp.total_message_count == 7
    assert sum(p.size_in_bytes for p in rp.partitions) == rp.size_in_bytes


def test_size_in_bytes_follows_the_messages(ns: Namespace) -> None:
    """size_in_bytes is 0 for an empty queue, grows with messages, and shrinks when they are completed."""
    ns.create_queue("q")
    assert ns.get_queue_runtime_properties("q").size_in_bytes == 0
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(b"x" * 10_000, partition_key="k") for _ in range(5)])
    full = ns.get_queue_runtime_properties("q").size_in_bytes
    assert full > 0
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(b"y" * 50_000, partition_key="k2") for _ in range(5)])
    assert ns.get_queue_runtime_properties("q").size_in_bytes > full
    with ns.get_queue_receiver("q") as r:
        r.complete_messages(drain(r, 10))
    assert ns.get_queue_runtime_properties("q").size_in_bytes == 0


def test_availability_is_limited_while_a_partition_is_down(ns: Namespace) -> None:
    """availability_status is "Limited" while any partition is unavailable, and "Available" again after."""
    ns.create_queue("q")
    faults = ns.fault_injector("q")
    faults.fail(6, ("read", "write"))
    rp = ns.get_queue_runtime_properties("q")
    assert rp.availability_status == "Limited"
    assert [p.partition_id for p in rp.partitions if not p.available] == [6]
    faults.heal()
    assert ns.get_queue_runtime_properties("q").availability_status == "Available"


# ---- management during a partition outage ----------------------------------------------------


def test_update_with_an_unavailable_partition_fails(ns: Namespace) -> None:
    """update_queue with a partition down raises PartitionUnavailableError and leaves the settings as they were."""
    ns.create_queue("q")
    ns.fault_injector("q").fail(11, ("read", "write"))
    props = ns.get_queue("q")
    props.max_delivery_count = 2
    with pytest.raises(PartitionUnavailableError):
        ns.update_queue(props)
    assert ns.get_queue("q").max_delivery_count == 10
    ns.fault_injector("q").heal()
    ns.update_queue(props)
    assert ns.get_queue("q").max_delivery_count == 2


def test_delete_with_an_unavailable_partition_fails(ns: Namespace) -> None:
    """delete_queue with a partition down raises PartitionUnavailableError; the queue and its messages remain."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", partition_key=f"k{i}") for i in range(4)])
    ns.fault_injector("q").fail(0, ("write",))
    with pytest.raises(PartitionUnavailableError):
        ns.delete_queue("q")
    ns.fault_injector("q").heal()
    assert [q.name for q in ns.list_queues()] == ["q"]
    assert ns.get_queue_runtime_properties("q").total_message_count == 4
    with ns.get_queue_receiver("q") as r:
        assert len(drain(r, 4)) == 4
    ns.delete_queue("q")
    assert ns.list_queues() == []


@pytest.mark.parametrize(
    "change",
    [
        lambda ns: ns.create_subscription("t", "s2"),
        lambda ns: ns.create_rule("t", "s", "r2", filter=SqlRuleFilter("a = 1")),
        lambda ns: ns.update_rule("t", "s", ns.get_rule("t", "s", "r"), filter=SqlRuleFilter("b = 2")),
        lambda ns: ns.delete_rule("t", "s", "r"),
    ],
    ids=["create_subscription", "create_rule", "update_rule", "delete_rule"],
)
def test_subscription_and_rule_changes_need_every_topic_partition(ns: Namespace, change: Any) -> None:
    """Subscriptions and rules live in their topic's table: with a partition down their management changes nothing."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_rule("t", "s", "r", filter=SqlRuleFilter("a = 2"))
    ns.fault_injector("t", "topic").fail(3, ("read", "write"))
    with pytest.raises(PartitionUnavailableError):
        change(ns)
    ns.fault_injector("t", "topic").heal()
    assert [s.name for s in ns.list_subscriptions("t")] == ["s"]
    rules = {r.name: r.filter for r in ns.list_rules("t", "s")}
    assert sorted(rules) == ["$Default", "r"] and rules["r"] == SqlRuleFilter("a = 2")
    change(ns)  # allowed again once the partition is back


@pytest.mark.parametrize("name", [5, None], ids=repr)
def test_update_with_a_name_that_is_not_a_string_is_refused(ns: Namespace, name: object) -> None:
    """A name of the wrong type in update_queue's dict or properties raises InvalidArgumentTypeError (a TypeError)."""
    ns.create_queue("q")
    with pytest.raises(InvalidArgumentTypeError):
        ns.update_queue({**dict(ns.get_queue("q")), "name": name, "max_delivery_count": 3})
    with pytest.raises(InvalidArgumentTypeError):
        ns.update_queue(dataclasses.replace(ns.get_queue("q"), name=name, max_delivery_count=3))
    assert ns.get_queue("q").max_delivery_count == 10


# ---- namespace -------------------------------------------------------------------------------


def test_catalog_survives_reopening(root: str) -> None:
    """Queues, settings and messages persist: a new Namespace on the same root sees them."""
    with Namespace(root) as first:
        first.create_queue("q", max_delivery_count=4, lock_duration=timedelta(seconds=20))
        with first.get_queue_sender("q") as s:
            s.send_messages(Message("persisted", message_id="p1"))
    with Namespace(root) as second:
        got = second.get_queue("q")
        assert (got.max_delivery_count, got.lock_duration) == (4, timedelta(seconds=20))
        with second.get_queue_receiver("q") as r:
            (m,) = drain(r, 1)
    assert (m.message_id, str(m)) == ("p1", "persisted")


def test_namespace_is_reentrant_after_close(root: str) -> None:
    """Namespace is a context manager that can be entered again after it was closed."""
    ns = Namespace(root)
    with ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("one"))
    with ns:
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("two"))
        with ns.get_queue_receiver("q") as r:
            got = drain(r, 2)
    assert sorted(str(m) for m in got) == ["one", "two"]
    ns.close()
    assert [q.name for q in ns.list_queues()] == ["q"]


def test_namespace_creates_its_root(tmp_path: Path) -> None:
    """Opening a namespace on a path that does not exist creates it."""
    root = tmp_path / "a" / "b" / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q")
    assert root.is_dir()
    with Namespace(str(root)) as again:
        assert [q.name for q in again.list_queues()] == ["q"]


@pytest.mark.parametrize("name", ["a%20b", "a\\b"])
def test_a_root_that_delta_rs_would_read_as_another_path_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    """delta-rs decodes '%20' and turns a backslash into '/': tables would be created somewhere else."""
    with pytest.raises(InvalidOperationError, match="URL escape"):
        Namespace(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["a b", "a#b", "a?b", "a%zz", "ä ö"])
def test_roots_with_unusual_characters_hold_entities_through_maintenance(tmp_path: Path, name: str) -> None:
    with Namespace(tmp_path / name) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            for i in range(3):
                s.send_messages(Message(f"m{i}"))
        ns.run_maintenance()
        with ns.get_queue_receiver("q") as r:
            got = r.receive_messages(10)
            r.complete_messages(got)
        assert sorted(str(m) for m in got) == ["m0", "m1", "m2"]
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_unknown_tier_is_refused(tmp_path: Path) -> None:
    """Only the "standard" and "premium" tiers exist."""
    for tier in ("basic", "Standard", ""):
        with pytest.raises(InvalidOperationError):
            Namespace(tmp_path / "ns", tier=tier)
    assert Namespace(tmp_path / "std").tier == "standard"


def test_a_namespace_keeps_the_tier_it_was_created_with(tmp_path: Path) -> None:
    """Opened without a tier, a premium namespace is premium (its limits hold); naming another tier is refused."""
    root = tmp_path / "p"
    with Namespace(root, tier="premium") as ns:
        ns.create_queue("big", max_size_in_megabytes=10240)
    with Namespace(root) as again:
        assert again.tier == "premium"
        again.update_queue(again.get_queue("big"), max_delivery_count=3)  # 10240 MB stays valid
        with again.get_queue_sender("big") as s:
            s.send_messages(Message(b"x" * 300_000))  # over the standard tier's 256 KB
    with pytest.raises(InvalidOperationError, match="premium namespace"):
        Namespace(root, tier="standard")
    assert Namespace(tmp_path / "new").tier == "standard"
    with pytest.raises(InvalidOperationError, match="standard namespace"):
        Namespace(tmp_path / "new", tier="premium")


def test_a_damaged_or_newer_namespace_marker_is_refused(tmp_path: Path) -> None:
    """The marker at the root is read on open: damage is reported, a newer format asks for an upgrade."""
    root = tmp_path / "ns"
    Namespace(root).close()
    marker = root / "_sparkqueue.json"
    marker.write_text('{"format_version": 99, "tier": "standard"}')
    with pytest.raises(InvalidOperationError, match="format version 99"):
        Namespace(root)
    for damaged in ("{", '{"tier": "standard"}', '{"format_version": 1, "tier": "gold"}'):
        marker.write_text(damaged)
        with pytest.raises(StorageCorruptedError):
            Namespace(root)


def test_premium_sizes(tmp_path: Path) -> None:
    """Premium allows max_size_in_megabytes up to 81920; standard refuses sizes above 5120."""
    with Namespace(tmp_path / "p", tier="premium") as premium:
        for size in (10240, 20480, 40960, 81920):
            premium.create_queue(f"q{size}", max_size_in_megabytes=size)
            assert premium.get_queue(f"q{size}").max_size_in_megabytes == size
    with Namespace(tmp_path / "s") as standard:
        for size in (1024, 2048, 3072, 4096, 5120):
            standard.create_queue(f"q{size}", max_size_in_megabytes=size)
        with pytest.raises(InvalidOperationError):
            standard.create_queue("big", max_size_in_megabytes=10240)
        assert len(standard.list_queues()) == 5


def test_at_most_100_partitioned_entities(ns: Namespace) -> None:
    """The 101st partitioned queue or topic raises QuotaExceededError; non-partitioned ones can still be created."""
    for i in range(60):
        ns.create_queue(f"q{i}")
    for i in range(40):
        ns.create_topic(f"t{i}")
    with pytest.raises(QuotaExceededError):
        ns.create_queue("one-too-many")
    with pytest.raises(QuotaExceededError):
        ns.create_topic("topic-too-many")
    assert len(ns.list_queues()) == 60
    ns.create_queue("unpartitioned", enable_partitioning=False)
    assert ns.get_queue("unpartitioned").enable_partitioning is False
    ns.delete_queue("q0")
    ns.create_queue("q-after-delete")


def test_runtime_properties_repr_is_short(ns: Namespace) -> None:
    """A REPL shows the counts, not sixteen partition records (they stay on .partitions)."""
    ns.create_queue("q")
    rp = ns.get_queue_runtime_properties("q")
    assert len(repr(rp)) < 1000 and "active_message_count=0" in repr(rp)
    assert len(rp.partitions) == 16


def test_the_administration_client_stands_on_a_broker_of_its_own(ns: Namespace) -> None:
    """Management holds a broker core (composition): built on a bare Broker it administers the same namespace."""
    from sparkqueue.broker import Broker
    from sparkqueue.management import Management

    admin = Management(Broker(ns.root))
    admin.create_queue("made-by-admin", max_delivery_count=3)
    assert ns.get_queue("made-by-admin").max_delivery_count == 3
    ns.create_topic("t")
    assert [t.name for t in admin.list_topics()] == ["t"]
    admin.delete_queue("made-by-admin")
    assert [q.name for q in ns.list_queues()] == []


def test_a_subscription_never_changes_its_topics_size_quota(ns: Namespace) -> None:
    """Topic and subscriptions share one table; only the topic's max_size_in_megabytes sets its partitions' quota."""
    ns.create_topic("t", max_size_in_megabytes=1024)
    ns.create_subscription("t", "s")
    ns.update_topic(ns.get_topic("t"), max_size_in_megabytes=5120)
    table = ns.broker.entity("topic", "t").table
    ns.get_subscription_runtime_properties("t", "s")  # loads the subscription over the same table
    ns.broker.entity("subscription", sub_entity_name("t", "s"))
    assert table.max_partition_bytes == 5120 * 1024 * 1024


def test_a_subscription_shows_its_topics_size_and_refuses_another(ns: Namespace) -> None:
    """A subscription's max_size_in_megabytes is its topic's as it is now; an update naming another is refused."""
    ns.create_topic("t")
    ns.create_subscription("t", "s", max_delivery_count=5)
    ns.update_topic(ns.get_topic("t"), max_size_in_megabytes=5120)
    props = ns.get_subscription("t", "s")
    assert props.max_size_in_megabytes == 5120
    assert [x.max_size_in_megabytes for x in ns.list_subscriptions("t")] == [5120]
    with pytest.raises(InvalidOperationError, match="update_topic"):
        ns.update_subscription("t", props, max_size_in_megabytes=2048, max_delivery_count=7)
    assert ns.get_subscription("t", "s").max_delivery_count == 5
    ns.update_subscription("t", props, max_delivery_count=7)  # its size as read: accepted
    assert (ns.get_subscription("t", "s").max_delivery_count, ns.get_subscription("t", "s").max_size_in_megabytes) == (7, 5120)


@pytest.mark.parametrize(
    ("setting", "value"), [("enable_partitioning", True), ("max_size_in_megabytes", 2048), ("max_size_in_megabytes", 12345)]
)
def test_a_new_subscription_refuses_settings_other_than_its_topics(ns: Namespace, setting: str, value: object) -> None:
    """create_subscription refuses a partitioning or size other than its topic's, as update_subscription does; nothing is made."""
    ns.create_topic("t", enable_partitioning=False)
    with pytest.raises(InvalidOperationError, match=f"subscription's {setting} is its topic's"):
        ns.create_subscription("t", "s", **{setting: value})
    assert ns.list_subscriptions("t") == []
    ns.create_subscription("t", "s", enable_partitioning=False, max_size_in_megabytes=1024)  # the topic's own: accepted
    ns.create_subscription("t", "s2", enable_partitioning=None, max_size_in_megabytes=None)  # the SDK's "not given"
    assert [(x.enable_partitioning, x.max_size_in_megabytes) for x in ns.list_subscriptions("t")] == [(False, 1024)] * 2


def test_a_name_given_twice_is_a_clear_error(ns: Namespace) -> None:
    """topic_name as a keyword besides the positional topic (a settings dict spread into the call) is refused clearly."""
    ns.create_topic("t")
    with pytest.raises(InvalidArgumentTypeError, match="'topic_name' both as an argument and as a keyword"):
        ns.create_subscription("t", "s", topic_name="t")
    assert ns.list_subscriptions("t") == []
    ns.create_subscription(topic_name="t", subscription_name="s")  # by keyword alone, as the SDK allows
    assert [x.name for x in ns.list_subscriptions("t")] == ["s"]


def test_enable_partitioning_has_no_effect_in_a_premium_update(premium_ns: Namespace) -> None:
    """Premium entities are never partitioned: True in an update is taken as False, as at creation, without an error."""
    premium_ns.create_queue("q", enable_partitioning=True)
    props = premium_ns.get_queue("q")
    assert props.enable_partitioning is False
    premium_ns.update_queue(props, enable_partitioning=True, max_delivery_count=4)
    got = premium_ns.get_queue("q")
    assert (got.enable_partitioning, got.max_delivery_count) == (False, 4)
    assert props.enable_partitioning is False  # the caller's object is not changed


def test_names_in_another_case_find_the_entity_as_stored(ns: Namespace) -> None:
    """As in Service Bus, a queue, topic or subscription named in another case is the entity as created, everywhere."""
    ns.create_queue("Orders")
    ns.create_topic("Events")
    ns.create_subscription("events", "Audit")
    ns.create_rule("EVENTS", "audit", "everything")
    assert (ns.get_queue("orders").name, ns.get_topic("EVENTS").name) == ("Orders", "Events")
    assert [s.name for s in ns.list_subscriptions("events")] == ["Audit"]
    assert [r.name for r in ns.list_rules("Events", "AUDIT")] == ["$Default", "everything"]
    with ns.get_queue_sender("ORDERS") as s:
        s.send_messages(Message("order"))
    with ns.get_topic_sender("events") as s:
        s.send_messages(Message("event"))
    with ns.get_queue_receiver("orders") as r:
        r.complete_messages(drain(r, 1))
    with ns.get_subscription_receiver("EVENTS", "audit") as r:
        assert [str(m) for m in drain(r, 1)] == ["event"]  # $Default and "everything" match: one copy between them
    ns.update_queue({**dict(ns.get_queue("orders")), "name": "ORDERS", "max_delivery_count": 3})
    assert [(q.name, q.max_delivery_count) for q in ns.list_queues()] == [("Orders", 3)]
    ns.delete_subscription("EVENTS", "AUDIT")  # its rules go with it
    ns.create_subscription("Events", "Audit")
    assert [r.name for r in ns.list_rules("Events", "Audit")] == ["$Default"]
    ns.delete_topic("events")
    ns.delete_queue("oRdErS")
    assert ns.list_queues() == [] and ns.list_topics() == []


def test_subscription_names_are_unique_in_their_topic_without_case(ns: Namespace) -> None:
    """As in Service Bus: "orders" beside "Orders" was created, both got every message, and "ORDERS" found neither."""
    ns.create_topic("t")
    ns.create_topic("other")
    ns.create_subscription("t", "Orders", max_delivery_count=4)
    with pytest.raises(EntityAlreadyExistsError, match="case does not count"):
        ns.create_subscription("T", "orders")
    ns.create_subscription("other", "orders")  # another topic's name space
    assert [s.name for s in ns.list_subscriptions("t")] == ["Orders"]
    assert ns.get_subscription("t", "ORDERS").max_delivery_count == 4
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x"))
    assert ns.get_subscription_runtime_properties("T", "oRdErS").active_message_count == 1


def test_rule_names_are_unique_in_their_subscription_without_case(ns: Namespace) -> None:
    """As in Service Bus: "audit" beside "Audit" was a second rule, and "AUDIT" found neither."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_subscription("t", "other")
    ns.create_rule("t", "s", "Audit", filter=SqlRuleFilter("n = 1"))
    with pytest.raises(EntityAlreadyExistsError, match="as 'Audit'"):
        ns.create_rule("t", "S", "audit", filter=SqlRuleFilter("n = 2"))
    with pytest.raises(EntityAlreadyExistsError, match=r"as '\$Default'"):
        ns.create_rule("t", "s", "$DEFAULT")
    ns.create_rule("t", "other", "audit")  # another subscription's name space
    assert sorted(r.name for r in ns.list_rules("t", "s")) == ["$Default", "Audit"]
    assert isinstance(ns.get_rule("T", "s", "AUDIT").filter, SqlRuleFilter)
    ns.update_rule("t", "s", RuleProperties("aUdIt", SqlRuleFilter("n = 3")))
    assert ns.get_rule("t", "s", "Audit").filter.sql_expression == "n = 3"
    ns.delete_rule("t", "s", "$default")
    ns.delete_rule("t", "s", "AUDIT")
    assert ns.list_rules("t", "s") == []
    with pytest.raises(EntityNotFoundError):
        ns.get_rule("t", "s", "audit")


def _delete_as_another_client(root: Path, kind: str, name: str) -> None:
    """Delete an entity through another Namespace (its own catalog and caches, as another process has), at once.

    A subprocess would take longer than the broker's settings cache (a second) to start, and this
    handle would then look the entity up again instead of using the table it holds.
    """
    with Namespace(root) as other:
        getattr(other, f"delete_{kind}")(name)


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("op", ["send", "transaction", "receive", "complete", "topic"])
def test_a_handle_used_after_another_client_deleted_its_entity_stores_nothing(tmp_path: Path, op: str) -> None:
    """A commit into a deleted table (a handle still holding its snapshot) raises EntityNotFoundError and leaves no file
    (the delete's tombstone stays, for such handles, until maintenance removes the folder).

    Before, the put-if-absent commit made the table's directories again and reported success: the
    message was lost, and its files stayed where no maintenance looks.
    """
    root = tmp_path / "ns"
    with Namespace(root) as ns:
        kind = "topic" if op == "topic" else "queue"
        if kind == "topic":
            ns.create_topic("q")
            ns.create_subscription("q", "s")
            sender = ns.get_topic_sender("q")
        else:
            ns.create_queue("q", enable_partitioning=False)
            sender = ns.get_queue_sender("q")
        receiver = ns.get_subscription_receiver("q", "s") if kind == "topic" else ns.get_queue_receiver("q")
        sender.send_messages([Message("a", partition_key="k"), Message("b", partition_key="k")])
        (got,) = receiver.receive_messages(1)
        _delete_as_another_client(root, kind, "q")
        with pytest.raises(EntityNotFoundError):
            if op in ("send", "topic"):
                sender.send_messages(Message("lost?"))
            elif op == "transaction":
                with ns.transaction():
                    sender.send_messages(Message("lost?", partition_key="k"))
            elif op == "receive":
                receiver.receive_messages(1)
            else:
                receiver.complete_message(got)
        assert [p.name for p in (root / "entities").rglob("*") if p.is_file()] == ["_sparkqueue_deleting"]
        assert ns.list_queues() == [] and ns.list_topics() == []


def test_a_namespace_removed_under_an_open_handle_is_not_recreated_by_its_next_change(tmp_path: Path) -> None:
    root = tmp_path / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q")
        shutil.rmtree(root)
        with pytest.raises(EntityNotFoundError):
            ns.create_queue("q2")
        with pytest.raises(EntityNotFoundError):
            ns.get_queue_sender("q").send_messages(Message("x"))
    assert [p for p in root.rglob("*") if p.is_file()] == []  # nothing written again (empty directories at most)


def test_an_update_from_a_partial_dict_is_refused_and_changes_nothing(ns: Namespace) -> None:
    """As the SDK: a dict stands for a whole properties object. Before, the missing settings were reset to defaults."""
    ns.create_queue("q", lock_duration=timedelta(seconds=30), user_metadata="keep", enable_partitioning=False)
    with pytest.raises(InvalidArgumentTypeError, match="missing: "):
        ns.update_queue({"name": "q", "max_delivery_count": 3})
    ns.update_queue({**dict(ns.get_queue("q")), "max_delivery_count": 3})
    got = ns.get_queue("q")
    assert (got.max_delivery_count, got.lock_duration, got.user_metadata) == (3, timedelta(seconds=30), "keep")


def test_an_update_racing_a_delete_and_create_of_its_queue_does_not_rewrite_the_new_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update's checks read one catalog entry; its commit applies only while the name still names that table.

    Before, the new queue (partitioned, with sessions) got the old one's fixed settings, and the
    messages of 15 of its partitions could no longer be reached.
    """
    from sparkqueue.storage.catalog import Catalog

    root = tmp_path / "ns"
    ns = Namespace(root)
    ns.create_queue("q", enable_partitioning=False)
    props = ns.get_queue("q")
    real = Catalog.update

    def another_client_first(self: Catalog, *args: Any, **kwargs: Any) -> bool:
        with Namespace(root) as other:  # between the update's checks and its catalog commit
            other.delete_queue("q")
            other.create_queue("q", requires_session=True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Catalog, "update", another_client_first)
    with pytest.raises(EntityNotFoundError, match="deleted meanwhile"):
        ns.update_queue(props, max_delivery_count=3)
    monkeypatch.undo()
    with Namespace(root) as fresh:
        got = fresh.get_queue("q")
    assert (got.enable_partitioning, got.requires_session, got.max_delivery_count) == (True, True, 10)


def test_a_lost_marker_over_a_catalog_with_entities_is_damage_not_a_new_namespace(tmp_path: Path) -> None:
    """Opened anew, it took the caller's tier: a standard namespace became premium and took 300 KB messages."""
    root = tmp_path / "ns"
    Namespace(root).close()
    (root / "_sparkqueue.json").unlink()  # lost before any entity: as a process killed before writing it
    Namespace(root).close()  # the catalog is empty: the marker is written again
    with Namespace(root) as ns:
        ns.create_queue("q")
    (root / "_sparkqueue.json").unlink()
    with pytest.raises(StorageCorruptedError, match="marker"):
        Namespace(root, tier="premium")
    assert not (root / "_sparkqueue.json").exists()


def test_a_namespace_pickles_as_its_location_so_a_spark_closure_can_capture_it(tmp_path: Path) -> None:
    import pickle

    with Namespace(tmp_path / "ns", operation_timeout=7) as ns:
        ns.create_queue("q")
        again = pickle.loads(pickle.dumps(ns))
        assert (again.root, again.tier, again.operation_timeout) == (ns.root, ns.tier, 7)
        with again.get_queue_sender("q") as s:
            s.send_messages(Message("x"))
        assert ns.get_queue_runtime_properties("q").active_message_count == 1
        frozen = pickle.dumps(ns)
    shutil.rmtree(tmp_path / "ns")
    with pytest.raises(EntityNotFoundError, match="no sparkqueue namespace"):  # a pickle reopens, never makes, one
        pickle.loads(frozen)
    assert not (tmp_path / "ns").exists()


def test_a_name_of_the_other_kind_is_named_in_the_error(ns: Namespace) -> None:
    """A subscription on a queue's name said only "topic 'orders' does not exist"; the error says what the name is."""
    ns.create_queue("orders")
    ns.create_topic("Events")
    with pytest.raises(EntityNotFoundError, match=r"topic 'orders' does not exist .*\('orders' is a queue\)"):
        ns.create_subscription("orders", "eu")
    with pytest.raises(EntityNotFoundError, match=r"queue 'events' does not exist .*\('events' is a topic\)"):
        ns.get_queue("events")
    with pytest.raises(EntityNotFoundError, match=r"queue 'nope' does not exist in namespace '[^']*'$"):
        ns.get_queue("nope")


def test_a_rule_name_is_unique_in_its_own_subscription_when_two_differ_only_in_case(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace made before subscription names ignored case may hold "Orders" and "orders" (each found by its exact
    name): a rule of one never blocks a rule of the same name on the other."""
    ns.create_topic("t")
    ns.create_subscription("t", "Orders")
    with monkeypatch.context() as old_code:  # the catalog check as it was: names matched with case
        old_code.setattr(management, "_same_entity_name", lambda kind, name: lambda key: key == f"{kind}:{name}")
        ns.create_subscription("t", "orders")
    ns.create_rule("t", "orders", "x")
    ns.create_rule("t", "Orders", "X")
    assert sorted(r.name for r in ns.list_rules("t", "orders")) == ["$Default", "x"]
    assert sorted(r.name for r in ns.list_rules("t", "Orders")) == ["$Default", "X"]
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_rule("t", "Orders", "x")
