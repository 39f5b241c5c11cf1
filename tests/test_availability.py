"""Partition availability (docs/semantics.md §1, §3, §10): a partition made unavailable by an injected storage fault.

Keyed sends to it fail and store nothing, unkeyed sends fail over, receives skip it, settlements
and management on it fail without changing anything, runtime properties report "Limited", and
once healed everything works again with nothing lost.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from procs import PARTITIONS, drain, drain_all, key_for_partition, peek_all

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace, SubQueue
from sparkqueue.errors import EntityNotFoundError, PartitionUnavailableError

DOWN = 5  # the partition the tests make unavailable
UP = 9  # a partition that stays available


def _fail(ns: Namespace, partition: int = DOWN, name: str = "q", entity_type: str = "queue") -> None:
    ns.fault_injector(name, entity_type).fail(partition, ("read", "write"))


def _heal(ns: Namespace, name: str = "q", entity_type: str = "queue") -> None:
    ns.fault_injector(name, entity_type).heal()


def _ids(msgs) -> list[str]:
    return sorted(m.message_id for m in msgs)


# ---- sends ------------------------------------------------------------------------------------


def test_keyed_send_to_unavailable_partition_fails_and_stores_nothing(ns: Namespace) -> None:
    """A keyed send to an unavailable partition raises PartitionUnavailableError and stores nothing (§3)."""
    ns.create_queue("q")
    down_key = key_for_partition(DOWN)
    _fail(ns)
    with ns.get_queue_sender("q") as s:
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("x", message_id="pinned", partition_key=down_key))
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("y", message_id="session", session_id=down_key))
    _heal(ns)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    with ns.get_queue_receiver("q") as r:
        assert peek_all(r) == []


def test_keyed_send_does_not_move_to_another_partition(ns: Namespace) -> None:
    """A key pins its message: a batch with one key on an unavailable partition fails as a whole, nothing stored."""
    ns.create_queue("q")
    batch = [
        Message("ok-1", message_id="ok-1", partition_key=key_for_partition(UP)),
        Message("free", message_id="free"),
        Message("bad", message_id="bad", partition_key=key_for_partition(DOWN)),
    ]
    _fail(ns)
    with ns.get_queue_sender("q") as s, pytest.raises(PartitionUnavailableError):
        s.send_messages(batch)
    rp = ns.get_queue_runtime_properties("q")
    assert rp.total_message_count == 0
    _heal(ns)
    with ns.get_queue_receiver("q") as r:
        assert peek_all(r) == []


def test_duplicate_detection_key_pins_message_id(ns: Namespace) -> None:
    """On a duplicate-detecting entity the message_id is the key: its unavailable partition fails the send."""
    ns.create_queue("q", requires_duplicate_detection=True)
    mid = key_for_partition(DOWN, prefix="mid")
    _fail(ns)
    with ns.get_queue_sender("q") as s, pytest.raises(PartitionUnavailableError):
        s.send_messages(Message("x", message_id=mid))
    _heal(ns)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_unkeyed_sends_fail_over_to_available_partitions(ns: Namespace) -> None:
    """Unkeyed sends skip an unavailable partition and all succeed, none stored in it (§3)."""
    ns.create_queue("q")
    _fail(ns)
    with ns.get_queue_sender("q") as s:
        for i in range(2 * PARTITIONS):
            (seq,) = s.send_messages(Message(f"m{i}", message_id=f"m{i}"))
            assert seq >> 48 != DOWN
    rp = ns.get_queue_runtime_properties("q")
    assert rp.active_message_count == 2 * PARTITIONS
    assert rp.partitions[DOWN].total_message_count == 0
    used = [p.partition_id for p in rp.partitions if p.total_message_count]
    assert len(used) > 1  # round-robin spreads them over the partitions that are up
    with ns.get_queue_receiver("q") as r:
        got = drain(r, 2 * PARTITIONS)
    assert _ids(got) == sorted(f"m{i}" for i in range(2 * PARTITIONS))
    assert all(m.partition_id != DOWN for m in got)


def test_unkeyed_sends_succeed_while_one_partition_is_up(ns: Namespace) -> None:
    """With all partitions but one down, every unkeyed send lands in the last one; with none up it fails."""
    ns.create_queue("q")
    inj = ns.fault_injector("q")
    for p in range(PARTITIONS):
        if p != UP:
            inj.fail(p, ("read", "write"))
    with ns.get_queue_sender("q") as s:
        seqs = [s.send_messages([Message(f"m{i}-{k}", message_id=f"m{i}-{k}") for k in range(3)]) for i in range(10)]
        assert {q >> 48 for batch in seqs for q in batch} == {UP}
        inj.fail(UP, ("write",))
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("nowhere", message_id="nowhere"))
    inj.heal()
    rp = ns.get_queue_runtime_properties("q")
    assert rp.total_message_count == 30
    assert rp.partitions[UP].total_message_count == 30
    with ns.get_queue_receiver("q") as r:
        assert "nowhere" not in {m.message_id for m in peek_all(r)}


# ---- receives and settlements -------------------------------------------------------------------


def test_receive_skips_unavailable_partition(ns: Namespace) -> None:
    """Receives return the messages of available partitions and none of the unavailable one (§10)."""
    ns.create_queue("q")
    down = [Message(f"d{i}", message_id=f"d{i}", partition_key=key_for_partition(DOWN)) for i in range(5)]
    up = [Message(f"u{i}", message_id=f"u{i}", partition_key=key_for_partition(UP)) for i in range(5)]
    with ns.get_queue_sender("q") as s:
        s.send_messages(down)
        s.send_messages(up)
    _fail(ns)
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
        assert _ids(got) == _ids(up)
        for m in got:
            r.complete_message(m)
        with pytest.raises(PartitionUnavailableError, match=rf"partition\(s\) {DOWN} of 'q'"):
            peek_all(r)  # a browse that skipped the partition's messages would read as if they did not exist
    _heal(ns)
    with ns.get_queue_receiver("q") as r:
        assert _ids(drain(r, 5)) == _ids(down)


def test_a_receive_that_can_read_no_partition_holding_its_messages_raises(ns: Namespace) -> None:
    """Receives skip an unavailable partition, but one whose only candidate partitions were all unavailable returned []
    as if the queue were empty: it raises PartitionUnavailableError naming them, after its wait (§10)."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"d{i}", message_id=f"d{i}", partition_key=key_for_partition(DOWN)) for i in range(3)])
    _fail(ns)
    with ns.get_queue_receiver("q") as r:
        with pytest.raises(PartitionUnavailableError, match=rf"nothing was received: partition\(s\) {DOWN} of 'q'.*read fault"):
            r.receive_messages(10, max_wait_time=0.2)
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("u", message_id="u", partition_key=key_for_partition(UP)))
        (m,) = r.receive_messages(10, max_wait_time=5)  # another partition holds one: it is read, the down one skipped
        assert m.message_id == "u"
        assert r.receive_messages(10, max_wait_time=0.2) == []  # UP still holds it (locked): read, nothing to take
        r.complete_message(m)
        with pytest.raises(PartitionUnavailableError, match=rf"partition\(s\) {DOWN} of 'q'"):
            r.receive_messages(10, max_wait_time=0.2)  # only the down partition holds messages again
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert dlq.receive_messages(10, max_wait_time=0.2) == []  # its statistics show no dead letter there
    _heal(ns)
    with ns.get_queue_receiver("q") as r:
        assert _ids(drain(r, 3)) == ["d0", "d1", "d2"]


def test_a_read_caught_by_another_handle_s_delete_reports_the_delete_and_marks_nothing(
    ns: Namespace, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another handle deleted queue q (and made it again) while this one's cached table still listed q's data files. The
    receive found them missing and called it damage: PartitionUnavailableError, and marks that kept the partitions of
    the NEW queue q unavailable in this process for 30 s (damage marks go by entity name). It reports the delete
    (EntityNotFoundError) and marks nothing; the next receive reads the new queue."""
    import sparkqueue.management as management
    from sparkqueue.storage.log import delete_table

    ns.create_queue("q")
    with Namespace(root, create=False) as sender, sender.get_queue_sender("q") as s:  # files this handle never read
        s.send_messages([Message(f"old{p}", partition_key=key_for_partition(p)) for p in range(PARTITIONS)])
    r = ns.get_queue_receiver("q", max_wait_time=0.5)
    paused: list[int] = []

    def delete_half_way(store, **kw):  # the delete caught half-way (tombstone, no data files, log still there) ...
        from sparkqueue.storage.log import LOG_DIR, TOMBSTONE

        store.put(TOMBSTONE, b"")
        for e in store.list():
            if e.path != TOMBSTONE and not e.path.startswith(f"{LOG_DIR}/"):
                store.delete(e.path)
        paused.append(1)
        return 0

    with Namespace(root, create=False) as other:
        monkeypatch.setattr(management, "delete_table", delete_half_way)
        other.delete_queue("q")
        assert paused
        with pytest.raises(EntityNotFoundError, match="was deleted while this read was under way"):
            r.receive_messages(10)  # this handle still trusts its cached settings (under a second old)
        monkeypatch.setattr(management, "delete_table", delete_table)
        other.create_queue("q")
        with other.get_queue_sender("q") as s:
            s.send_messages([Message(f"new{p}", partition_key=key_for_partition(p)) for p in range(PARTITIONS)])
    assert sorted(str(m) for m in drain(r, PARTITIONS)) == sorted(f"new{p}" for p in range(PARTITIONS))
    assert ns.get_queue_runtime_properties("q").availability_status == "Available"
    r.close()


def test_damage_found_in_a_deleted_queue_does_not_mark_the_queue_made_again_under_its_name(ns: Namespace, root: str) -> None:
    """Damage marks go by entity name: a partition found damaged in queue q stayed unavailable, for 30 s, in the new
    queue q another handle made after deleting the damaged one. A new table's handle starts without them."""
    import time

    from sparkqueue.broker.core import PROPERTIES_TTL_S

    ns.create_queue("q")
    with Namespace(root, create=False) as sender, sender.get_queue_sender("q") as s:  # files this handle never read
        s.send_messages(Message("old", partition_key=key_for_partition(DOWN)))
    table = ns.broker.entity("queue", "q").table
    (victim,) = [f for f in table.snapshot().files if f.partition == DOWN]
    with open(f"{table.uri}/{victim.path}", "wb"):
        pass  # emptied: real damage
    with ns.get_queue_receiver("q") as r, pytest.raises(PartitionUnavailableError, match=f"partition\\(s\\) {DOWN}"):
        r.receive_messages(5, max_wait_time=0.2)
    with Namespace(root, create=False) as other:
        other.delete_queue("q")
        other.create_queue("q")
        with other.get_queue_sender("q") as s:
            s.send_messages(Message("new", partition_key=key_for_partition(DOWN)))
    time.sleep(PROPERTIES_TTL_S + 0.2)  # this handle's cached settings lapse: it looks q up again
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in r.receive_messages(5, max_wait_time=2)] == ["new"]
    assert ns.get_queue_runtime_properties("q").availability_status == "Available"


def test_next_available_session_skips_a_partition_its_own_read_finds_damaged(ns: Namespace, root: str) -> None:
    """A session queue's file in partition 5 damaged on disk (not a fault already known): NEXT_AVAILABLE_SESSION raised
    PartitionUnavailableError whenever its rotating start reached partition 5 before the healthy session in 9, so a
    session-pool loop ending on OperationTimeoutError died. It skips the partition, as receives do."""
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("sq") as s:
        for p in (DOWN, UP):
            s.send_messages([Message(f"{p}-{i}", session_id=key_for_partition(p, "sess")) for i in range(3)])
    table = ns.broker.entity("queue", "sq").table
    (victim,) = [f for f in table.snapshot().files if f.partition == DOWN]
    with open(f"{table.uri}/{victim.path}", "wb"):
        pass  # emptied
    for _ in range(8):  # fresh handles: each pass starts at another partition, most of them reaching 5 before 9
        with Namespace(root, create=False) as fresh, fresh.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION) as r:
            assert r.session.session_id == key_for_partition(UP, "sess")
    with Namespace(root, create=False) as fresh:
        with fresh.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION) as r:
            r.complete_messages(r.receive_messages(3, max_wait_time=1))  # the healthy session done: only 5 holds any
        with pytest.raises(PartitionUnavailableError, match="no session was accepted"):
            fresh.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.5)  # reported, not "none"


def test_peek_raises_for_an_unavailable_partition_it_must_read_and_keeps_its_place(ns: Namespace) -> None:
    """A browse never skips messages: it raises while a partition it must read is down (one a sequence number starts
    past is not read), and once healed the same receiver's browse continues where it stood, missing nothing."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        for p in (2, DOWN, UP):
            s.send_messages([Message(f"p{p}-{i}", message_id=f"p{p}-{i}", partition_key=key_for_partition(p)) for i in range(2)])
    _fail(ns)
    with ns.get_queue_receiver("q") as r:
        assert [m.message_id for m in r.peek_messages(1, sequence_number=0)] == ["p2-0"]
        with pytest.raises(PartitionUnavailableError, match=rf"nothing was browsed: partition\(s\) {DOWN} of 'q'"):
            r.peek_messages(10)  # p2-1 comes before the down partition: not returned either, the cursors stay
        _heal(ns)
        rest = ["p2-1", f"p{DOWN}-0", f"p{DOWN}-1", f"p{UP}-0", f"p{UP}-1"]
        assert [m.message_id for m in r.peek_messages(10)] == rest
        _fail(ns)
        after_down = r.peek_messages(10, sequence_number=(DOWN + 1) << 48)  # starts past the down partition: not read
        assert [m.message_id for m in after_down] == [f"p{UP}-0", f"p{UP}-1"]
    _heal(ns)
    ns.fault_injector("q").fail(DOWN, ("write",))  # a write fault leaves reads alone: the browse reads the partition
    with ns.get_queue_receiver("q") as r:
        assert len(peek_all(r)) == 6


def test_receive_from_dead_letter_queue_skips_unavailable_partition(ns: Namespace) -> None:
    """The dead-letter sub-queue is read with the same rule: the unavailable partition is skipped."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("d", message_id="d", partition_key=key_for_partition(DOWN)))
        s.send_messages(Message("u", message_id="u", partition_key=key_for_partition(UP)))
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 2):
            r.dead_letter_message(m, reason="test")
    _fail(ns)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert _ids(drain_all(dlq)) == ["u"]
    _heal(ns)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        assert "d" in _ids(drain_all(dlq))


def test_settle_in_unavailable_partition_fails_and_keeps_the_lock(ns: Namespace) -> None:
    """Settling a message of an unavailable partition raises PartitionUnavailableError and changes nothing."""
    ns.create_queue("q", lock_duration=timedelta(minutes=5))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("d", message_id="d", partition_key=key_for_partition(DOWN)))
    with ns.get_queue_receiver("q") as r:
        (m,) = drain(r, 1)
        _fail(ns)
        with pytest.raises(PartitionUnavailableError):
            r.complete_message(m)
        with pytest.raises(PartitionUnavailableError):
            r.abandon_message(m)
        with pytest.raises(PartitionUnavailableError):
            r.dead_letter_message(m, reason="nope")
        with pytest.raises(PartitionUnavailableError):
            r.renew_message_lock(m)
        _heal(ns)
        (peeked,) = peek_all(r)
        # the delivery in progress (still locked) is not counted yet, as in the SDK
        assert (peeked.message_id, peeked.delivery_count, peeked.state, peeked.dead_letter_reason) == ("d", 0, "active", None)
        assert peeked.locked_until_utc == m.locked_until_utc  # the renewal did not happen
        assert r.receive_messages(max_message_count=1, max_wait_time=0.2) == []  # still locked by us
        r.complete_message(m)  # the original token still holds
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


# ---- management ------------------------------------------------------------------------------------


def test_update_refused_while_a_partition_is_unavailable(ns: Namespace) -> None:
    """update_queue with a partition down raises PartitionUnavailableError and leaves the settings as they were (§1)."""
    ns.create_queue("q", max_delivery_count=7)
    props = ns.get_queue("q")
    props.max_delivery_count = 3
    props.lock_duration = timedelta(seconds=45)
    _fail(ns)
    with pytest.raises(PartitionUnavailableError):
        ns.update_queue(props)
    got = ns.get_queue("q")
    assert (got.max_delivery_count, got.lock_duration) == (7, timedelta(seconds=60))
    _heal(ns)
    ns.update_queue(props)
    got = ns.get_queue("q")
    assert (got.max_delivery_count, got.lock_duration) == (3, timedelta(seconds=45))


def test_delete_refused_while_a_partition_is_unavailable(ns: Namespace) -> None:
    """delete_queue with a partition down raises PartitionUnavailableError; the queue and its messages remain."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", message_id=f"m{i}", partition_key=f"k{i}") for i in range(20)])
    _fail(ns)
    with pytest.raises(PartitionUnavailableError):
        ns.delete_queue("q")
    assert [q.name for q in ns.list_queues()] == ["q"]
    _heal(ns)
    with ns.get_queue_receiver("q") as r:
        assert _ids(drain(r, 20)) == sorted(f"m{i}" for i in range(20))
    ns.delete_queue("q")
    assert ns.list_queues() == []


# ---- runtime properties -----------------------------------------------------------------------------


def test_runtime_properties_report_limited_with_the_partition_flag(ns: Namespace) -> None:
    """Runtime properties say "Limited" and mark exactly the unavailable partition; "Available" once healed."""
    ns.create_queue("q")
    assert ns.get_queue_runtime_properties("q").availability_status == "Available"
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("u", partition_key=key_for_partition(UP)), Message("d", partition_key=key_for_partition(DOWN))])
    _fail(ns)
    rp = ns.get_queue_runtime_properties("q")
    assert rp.availability_status == "Limited"
    assert [p.partition_id for p in rp.partitions if not p.available] == [DOWN]
    assert len(rp.partitions) == PARTITIONS
    assert rp.partitions[UP].active_message_count == 1
    _heal(ns)
    rp = ns.get_queue_runtime_properties("q")
    assert rp.availability_status == "Available"
    assert all(p.available for p in rp.partitions)
    assert rp.active_message_count == 2


def test_write_fault_alone_makes_the_partition_unavailable(ns: Namespace) -> None:
    """A write-only fault also counts: keyed sends fail, the entity is "Limited" and unkeyed sends avoid the partition."""
    ns.create_queue("q")
    ns.fault_injector("q").fail(DOWN, ("write",))
    with ns.get_queue_sender("q") as s:
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("x", partition_key=key_for_partition(DOWN)))
        for i in range(PARTITIONS):
            assert s.send_messages(Message(f"m{i}"))[0] >> 48 != DOWN
    assert ns.get_queue_runtime_properties("q").availability_status == "Limited"


# ---- topics ---------------------------------------------------------------------------------------


def test_topic_fault_applies_to_its_subscriptions(ns: Namespace) -> None:
    """A fault on a topic's partition: keyed topic sends fail, subscription receivers skip it, subscriptions are "Limited"."""
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message(f"d{i}", message_id=f"d{i}", partition_key=key_for_partition(DOWN)) for i in range(3)])
        s.send_messages([Message(f"u{i}", message_id=f"u{i}", partition_key=key_for_partition(UP)) for i in range(3)])
    _fail(ns, name="t", entity_type="topic")
    with ns.get_topic_sender("t") as s:
        with pytest.raises(PartitionUnavailableError):
            s.send_messages(Message("late", partition_key=key_for_partition(DOWN)))
        assert s.send_messages(Message("free", message_id="free"))[0] >> 48 != DOWN
    for sub in ("a", "b"):
        rp = ns.get_subscription_runtime_properties("t", sub)
        assert rp.availability_status == "Limited"
        assert [p.partition_id for p in rp.partitions if not p.available] == [DOWN]
        with ns.get_subscription_receiver("t", sub) as r:
            assert _ids(drain_all(r)) == ["free", "u0", "u1", "u2"]
    assert ns.get_topic_runtime_properties("t").availability_status == "Limited"
    sub_props = ns.get_subscription("t", "a")
    sub_props.max_delivery_count = 2
    with pytest.raises(PartitionUnavailableError):
        ns.update_subscription("t", sub_props)
    with pytest.raises(PartitionUnavailableError):
        ns.delete_subscription("t", "b")
    with pytest.raises(PartitionUnavailableError):
        ns.delete_topic("t")
    assert ns.get_subscription("t", "a").max_delivery_count == 10
    assert sorted(s.name for s in ns.list_subscriptions("t")) == ["a", "b"]
    _heal(ns, name="t", entity_type="topic")
    for sub in ("a", "b"):
        with ns.get_subscription_receiver("t", sub) as r:
            assert _ids(drain(r, 3, timeout_s=5)) == ["d0", "d1", "d2"]


def test_queue_fault_does_not_affect_other_entities(ns: Namespace) -> None:
    """A fault is per table: another queue's same partition stays available."""
    ns.create_queue("q")
    ns.create_queue("other")
    _fail(ns)
    with ns.get_queue_sender("other") as s:
        s.send_messages(Message("x", message_id="x", partition_key=key_for_partition(DOWN)))
    assert ns.get_queue_runtime_properties("other").availability_status == "Available"
    with ns.get_queue_receiver("other") as r:
        assert _ids(drain(r, 1)) == ["x"]


# ---- healing ----------------------------------------------------------------------------------------


def test_after_healing_everything_works_and_nothing_was_lost(ns: Namespace) -> None:
    """Across a fault and its healing no accepted message is lost or duplicated, and keyed sends work again."""
    ns.create_queue("q")
    accepted: set[str] = set()
    refused: set[str] = set()
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"pre{i}", message_id=f"pre{i}", partition_key=f"k{i}") for i in range(32)])
        accepted |= {f"pre{i}" for i in range(32)}
        _fail(ns)
        for i in range(32):
            mid = f"during{i}"
            try:
                s.send_messages(Message(mid, message_id=mid, partition_key=f"k{i}"))
                accepted.add(mid)
            except PartitionUnavailableError:
                refused.add(mid)
            s.send_messages(Message(f"free{i}", message_id=f"free{i}"))
            accepted.add(f"free{i}")
        assert refused  # some keys map to the failed partition
        with ns.get_queue_receiver("q") as r:
            got = drain_all(r)
            for m in got:
                r.complete_message(m)
        seen_during = {m.message_id for m in got}
        _heal(ns)
        s.send_messages([Message(m, message_id=m, partition_key=f"k{m[6:]}") for m in sorted(refused)])
        accepted |= refused
    with ns.get_queue_receiver("q") as r:
        got_after = drain_all(r)
        for m in got_after:
            r.complete_message(m)
    after = [m.message_id for m in got_after]
    assert len(after) == len(set(after))
    assert seen_during.isdisjoint(after)
    assert seen_during | set(after) == accepted
    rp = ns.get_queue_runtime_properties("q")
    assert (rp.availability_status, rp.total_message_count) == ("Available", 0)
