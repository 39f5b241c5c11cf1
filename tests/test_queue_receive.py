"""Receiving from queues: modes, gathering across partitions, waiting, prefetch, ordering, locks,
peeking and iteration (docs/semantics.md §5, §10, §11)."""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from procs import drain, drain_all, key_for_partition, peek_all, sleep_past

from sparkqueue import Message, Namespace, ReceiveMode
from sparkqueue.errors import InvalidOperationError, PartitionUnavailableError


def _send(ns: Namespace, msgs: list[Message], queue: str = "q") -> list[int]:
    with ns.get_queue_sender(queue) as s:
        return s.send_messages(msgs)


def test_peek_lock_is_the_default_mode(ns: Namespace) -> None:
    """A receiver defaults to PEEK_LOCK: messages come with a lock and stay stored until settled."""
    ns.create_queue("q")
    _send(ns, [Message("a")])
    with ns.get_queue_receiver("q") as r:
        assert r.receive_mode == ReceiveMode.PEEK_LOCK
        (m,) = drain(r, 1)
        assert m.lock_token is not None
        assert m.locked_until_utc is not None
        assert ns.get_queue_runtime_properties("q").total_message_count == 1
        with ns.get_queue_receiver("q") as other:
            assert other.receive_messages(max_message_count=5, max_wait_time=0.3) == []


def test_receive_and_delete_removes_on_receipt(ns: Namespace) -> None:
    """RECEIVE_AND_DELETE returns messages without a lock and removes them from the queue."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        got = drain(r, 3)
        assert sorted(str(m) for m in got) == ["m0", "m1", "m2"]
        assert all(m.lock_token is None for m in got)
        assert all(m.delivery_count == 0 for m in got)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    with ns.get_queue_receiver("q") as r:
        assert peek_all(r) == []
        assert r.receive_messages(max_message_count=5, max_wait_time=0.2) == []


def test_one_receive_gathers_from_several_partitions(ns: Namespace) -> None:
    """One receive_messages call collects messages spread over partitions, up to max_message_count."""
    ns.create_queue("q")
    parts = [0, 3, 7, 12, 15]
    _send(ns, [Message(f"p{p}", partition_key=key_for_partition(p, "g")) for p in parts])
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(max_message_count=10)
    assert sorted(m.partition_id for m in got) == parts


def test_max_message_count_caps_a_receive(ns: Namespace) -> None:
    """A receive returns at most max_message_count messages, and that many when that many wait; the default is one."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}", partition_key=f"k{i % 4}") for i in range(12)])
    with ns.get_queue_receiver("q") as r:
        assert len(r.receive_messages(max_wait_time=2)) == 1
        got = r.receive_messages(max_message_count=4, max_wait_time=2)
        assert len(got) == 4
        rest = drain_all(r)
    assert len(rest) == 7
    assert len({m.body for m in [*got, *rest]}) == 11


def _live_files(root: str) -> set[str]:
    """The live data files of the namespace's one queue, as delta-rs reads them from the log."""
    (path,) = glob.glob(f"{root}/entities/queue-*")
    return set(DeltaTable(path).file_uris())


def test_a_receive_fills_its_count_from_the_next_file_in_order(ns: Namespace, root: str) -> None:
    """A receive returns what is available up to its count (docs/semantics.md §5). One that held half its count used to stop
    before a file it would have to split, returning 70 of 100 with 170 waiting; it now takes part of that file in
    sequence order, and the rest of the file stays receivable. A count that ends on a file boundary splits nothing."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"a{i}") for i in range(70)])
    _send(ns, [Message(f"b{i}") for i in range(100)])
    with ns.get_queue_receiver("q") as r:
        first = r.receive_messages(max_message_count=100)
        assert [m.body for m in first] == [f"a{i}".encode() for i in range(70)] + [f"b{i}".encode() for i in range(30)]
        r.complete_messages(first)
        before = _live_files(root)
        nxt = r.receive_messages(max_message_count=70)
        assert [m.body for m in nxt] == [f"b{i}".encode() for i in range(30, 100)]
        assert not before & _live_files(root)  # the whole remaining file was taken: locked rows in a file of their own
        r.complete_messages(nxt)
    assert ns.get_queue_runtime_properties("q").active_message_count == 0


def test_a_receive_that_splits_a_file_leaves_the_rest_in_files_of_its_count(ns: Namespace, root: str) -> None:
    """receive(100) from a file of 1,000 rewrote the other 900 as one file, which the next receive(100) rewrote again
    (800 rows), and so on: a lock cost the file, not its count (docs/storage.md, "Receives fill their count"). The
    rest now goes to files of 100, so each later receive(100) takes one whole file and rewrites none."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(1000)])
    (path,) = glob.glob(f"{root}/entities/queue-*")

    def rows_by_file() -> dict[str, int]:
        adds = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pydict()
        return dict(zip(adds["path"], adds["num_records"], strict=True))

    with ns.get_queue_receiver("q") as r:
        first = r.receive_messages(max_message_count=100)
        assert [m.body for m in first] == [f"m{i}".encode() for i in range(100)]
        assert sorted(rows_by_file().values()) == [100] * 10  # 100 locked, the other 900 in nine files
        r.complete_messages(first)
        for k in range(1, 10):
            before = rows_by_file()
            got = r.receive_messages(max_message_count=100)
            assert [m.body for m in got] == [f"m{i}".encode() for i in range(100 * k, 100 * k + 100)]
            after = rows_by_file()
            assert len(set(before) - set(after)) == 1, "the receive rewrote more than the file it took"
            assert [after[f] for f in set(after) - set(before)] == [100]
            r.complete_messages(got)
    assert ns.get_queue_runtime_properties("q").active_message_count == 0


@pytest.mark.parametrize(("sent", "count", "files"), [(250, 1, [1, 49, 100, 100]), (1000, 99, [99, 109, 198, 198, 198, 198])])
def test_a_small_receive_splits_a_file_into_files_of_a_multiple_of_its_count(
    ns: Namespace, root: str, sent: int, count: int, files: list[int]
) -> None:
    """A receive of fewer than 100 messages leaves the rest in files of a multiple of its count of at least 100 rows:
    receive(1) from a file of 250 leaves files of 100, 100 and 49, not 249 files of one row; receive(99) leaves files of
    198 (two receives each), not of 100, which left a file of one row that split the next file again."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(sent)])
    (path,) = glob.glob(f"{root}/entities/queue-*")
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(max_message_count=count)
        assert [m.body for m in got] == [f"m{i}".encode() for i in range(count)]
    assert sorted(pa.table(DeltaTable(path).get_add_actions(flatten=True)).column("num_records").to_pylist()) == files


def test_a_split_keeps_files_of_large_messages_at_megabytes(ns: Namespace, root: str) -> None:
    """The rest of a split file went to files of 800 KB (the byte cap shrank with the 100-row cap): 29 messages of
    200 KB became eight files. They stay within the usual 8 MB cap: one file."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        batch = s.create_message_batch(max_size_in_bytes=8 * 1024 * 1024)
        for _ in range(30):
            batch.add_message(Message(bytes(200_000)))
        s.send_messages(batch)
    (path,) = glob.glob(f"{root}/entities/queue-*")
    with ns.get_queue_receiver("q") as r:
        assert len(r.receive_messages(max_message_count=1)) == 1
    assert sorted(pa.table(DeltaTable(path).get_add_actions(flatten=True)).column("num_records").to_pylist()) == [1, 29]


def test_a_receive_gathers_from_several_partitions_up_to_its_count(ns: Namespace) -> None:
    """With 60 messages in each of two partitions, receive(100) returned the 60 of one (docs/semantics.md §5: one call
    gathers from several partitions when one holds fewer than asked): it returns 100, from both, then the other 20."""
    ns.create_queue("q")
    _send(ns, [Message(f"a{i}", partition_key=key_for_partition(3, "a")) for i in range(60)])
    _send(ns, [Message(f"b{i}", partition_key=key_for_partition(9, "b")) for i in range(60)])
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(max_message_count=100)
        assert len(got) == 100 and {m.partition_id for m in got} == {3, 9}
        assert len(r.receive_messages(max_message_count=100)) == 20


def test_a_receive_slow_to_gather_stops_taking_partitions_before_its_first_locks_could_lapse(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive locked partition after partition however long it took: under load, receive(100) with 2 s locks returned
    locks with 0.2 s left. It takes no new partition once it has been locking for a sixth of the lock duration.

    Each partition's lock here takes 0.4 s more (16 of them: 6.4 s, past the 5 s lock); the receive stops after a few,
    every lock it returns has most of its duration left, and the rest wait for the next receive, none lost."""
    from sparkqueue.model.entity import Entity

    ns.create_queue("q", lock_duration=timedelta(seconds=5))
    _send(ns, [Message(f"p{p}-{i}", partition_key=key_for_partition(p, f"k{p}")) for p in range(16) for i in range(4)])
    lock_partition = Entity.receive_partition

    def slow(self: Entity, *args: object, **kwargs: object) -> pa.Table:
        rows = lock_partition(self, *args, **kwargs)  # type: ignore[arg-type]
        time.sleep(0.4)
        return rows

    monkeypatch.setattr(Entity, "receive_partition", slow)
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(max_message_count=64, max_wait_time=1)
        returned = datetime.now(UTC)
        assert 0 < len(got) < 64
        assert min(m.locked_until_utc for m in got) > returned + timedelta(seconds=2.5)
        monkeypatch.undo()
        rest = drain(r, 64 - len(got))
    assert sorted(m.body for m in got + rest) == sorted(f"p{p}-{i}".encode() for p in range(16) for i in range(4))


def test_max_wait_time_returns_empty_list_when_nothing_arrives(ns: Namespace) -> None:
    """With nothing to receive, receive_messages waits up to max_wait_time and returns []."""
    ns.create_queue("q")
    with ns.get_queue_receiver("q") as r:
        start = time.monotonic()
        assert r.receive_messages(max_message_count=3, max_wait_time=0.5) == []
        assert time.monotonic() - start >= 0.45, "the receive returned before max_wait_time"
        assert r.receive_messages(max_message_count=3, max_wait_time=timedelta(milliseconds=200)) == []


def test_receive_returns_a_message_that_arrives_during_the_wait(ns: Namespace) -> None:
    """A message sent while a receive waits is returned by that receive."""
    ns.create_queue("q")
    sender = threading.Timer(0.4, lambda: _send(ns, [Message("late")]))
    with ns.get_queue_receiver("q") as r:
        sender.start()
        try:
            got = r.receive_messages(max_message_count=1, max_wait_time=10)
        finally:
            sender.join()
    assert [str(m) for m in got] == ["late"]


def test_receiver_default_max_wait_time(ns: Namespace) -> None:
    """max_wait_time set on the receiver applies to receives that do not pass one."""
    ns.create_queue("q")
    with ns.get_queue_receiver("q", max_wait_time=0.4) as r:
        start = time.monotonic()
        assert r.receive_messages() == []
        assert time.monotonic() - start >= 0.35


def test_prefetched_messages_are_locked_and_invisible_to_others(ns: Namespace) -> None:
    """Messages in one receiver's prefetch cache are locked: another receiver cannot get them; the cache serves them."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(5)])
    with ns.get_queue_receiver("q", prefetch_count=10) as a:
        first = a.receive_messages(max_message_count=1, max_wait_time=2)
        assert [str(m) for m in first] == ["m0"]
        with ns.get_queue_receiver("q") as b:
            assert b.receive_messages(max_message_count=5, max_wait_time=0.3) == []
        with ns.get_queue_receiver("q") as browser:
            assert len(peek_all(browser)) == 5
        rest = a.receive_messages(max_message_count=10)
        assert [str(m) for m in rest] == ["m1", "m2", "m3", "m4"]
        assert all(m.lock_token for m in rest)
        a.complete_messages(first + rest)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_closing_a_receiver_releases_its_prefetched_messages(ns: Namespace) -> None:
    """Closing a receiver releases the messages in its prefetch cache at once."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(4)])
    a = ns.get_queue_receiver("q", prefetch_count=10)
    (taken,) = a.receive_messages(max_message_count=1, max_wait_time=2)
    with ns.get_queue_receiver("q") as b:
        assert b.receive_messages(max_message_count=5) == []
        a.close()
        got = b.receive_messages(max_message_count=5)
    assert sorted(str(m) for m in got) == ["m1", "m2", "m3"]
    assert str(taken) == "m0"


def test_closing_a_receiver_gives_back_its_prefetched_messages_undelivered(ns: Namespace) -> None:
    """Prefetched messages a close releases were never handed out: their delivery does not count (nor dead-letters them)."""
    ns.create_queue("q", enable_partitioning=False, max_delivery_count=1)
    _send(ns, [Message(f"m{i}") for i in range(4)])
    a = ns.get_queue_receiver("q", prefetch_count=10)
    (taken,) = a.receive_messages(max_message_count=1, max_wait_time=2)
    a.complete_message(taken)
    a.close()
    with ns.get_queue_receiver("q") as b:
        got = b.receive_messages(max_message_count=5, max_wait_time=2)
    assert sorted((str(m), m.delivery_count) for m in got) == [("m1", 0), ("m2", 0), ("m3", 0)]
    assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 0


def test_close_does_not_raise_after_the_queue_was_deleted(ns: Namespace, caplog: pytest.LogCaptureFixture) -> None:
    """As the SDK's close, closing never raises: a deleted queue's prefetched messages are logged, and the receiver closes."""
    ns.create_queue("q", enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(3)])
    r = ns.get_queue_receiver("q", prefetch_count=5)
    assert len(r.receive_messages(max_message_count=1, max_wait_time=2)) == 1
    ns.delete_queue("q")
    time.sleep(1.1)  # past the process's cached settings
    with caplog.at_level(logging.WARNING, logger="sparkqueue.receiver"):
        r.close()
    assert r.closed
    assert "lapse at expiry" in caplog.text


def test_close_with_a_partition_down_releases_the_other_partitions(ns: Namespace, caplog: pytest.LogCaptureFixture) -> None:
    """Closing with an unavailable partition does not raise: the other partitions' prefetched messages are released."""
    ns.create_queue("q")
    _send(ns, [Message(f"{p}-{i}", partition_key=key_for_partition(p, "c")) for p in (3, 7) for i in range(2)])
    r = ns.get_queue_receiver("q", prefetch_count=10)
    (taken,) = r.receive_messages(max_message_count=1, max_wait_time=2)  # the other three wait in the cache
    faults = ns.fault_injector("q")
    faults.fail(3, ("read", "write"))
    with caplog.at_level(logging.WARNING, logger="sparkqueue.receiver"):
        r.close()
    assert r.closed
    assert "locked until expiry" in caplog.text
    with ns.get_queue_receiver("q") as b:
        assert sorted(str(m) for m in drain_all(b)) == sorted({"7-0", "7-1"} - {str(taken)})
        faults.heal()
        assert drain_all(b) == []  # partition 3's prefetched messages stay locked until their lock expires


def test_messages_of_a_partition_come_in_sequence_order(ns: Namespace) -> None:
    """Within a partition, messages are received in sequence-number order."""
    ns.create_queue("q")
    keys = [key_for_partition(p, "ord") for p in (2, 9)]
    with ns.get_queue_sender("q") as s:
        for i in range(10):
            for k in keys:
                s.send_messages([Message(f"{k}-{i}-{j}", partition_key=k) for j in range(2)])
    with ns.get_queue_receiver("q") as r:
        got = []
        while len(got) < 40:
            batch = r.receive_messages(max_message_count=7, max_wait_time=2)
            assert batch
            got.extend(batch)
    for p in (2, 9):
        seqs = [m.sequence_number for m in got if m.partition_id == p]
        assert len(seqs) == 20
        assert seqs == sorted(seqs)


def test_each_delivery_gets_a_fresh_lock(ns: Namespace) -> None:
    """Every delivery has a new lock token, locked_until = now + lock_duration, and one more delivery_count (0 first)."""
    ns.create_queue("q", lock_duration=timedelta(seconds=30))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as r:
        before = datetime.now(UTC)
        (m1,) = drain(r, 1)
        after = datetime.now(UTC)
        assert m1.delivery_count == 0
        assert m1.locked_until_utc is not None
        assert before + timedelta(seconds=30) <= m1.locked_until_utc <= after + timedelta(seconds=30)
        r.abandon_message(m1)
        (m2,) = drain(r, 1)
    assert m2.sequence_number == m1.sequence_number
    assert m2.lock_token != m1.lock_token
    assert m2.delivery_count == 1


def test_expired_lock_makes_the_message_available_again(ns: Namespace) -> None:
    """When a lock expires the message can be received again, with a new token and a higher delivery count."""
    ns.create_queue("q", lock_duration=timedelta(seconds=2))
    _send(ns, [Message("x")])
    with ns.get_queue_receiver("q") as a, ns.get_queue_receiver("q") as b:
        (m1,) = drain(a, 1)
        assert b.receive_messages(max_message_count=1) == []
        assert m1.locked_until_utc is not None
        sleep_past(m1.locked_until_utc)
        (m2,) = drain(b, 1)
    assert m2.sequence_number == m1.sequence_number
    assert m2.lock_token != m1.lock_token
    assert m2.delivery_count == 1


def test_prefetched_messages_whose_lock_expired_are_not_served(ns: Namespace) -> None:
    """A receive never returns a prefetched message whose lock has expired; it is received afresh instead."""
    ns.create_queue("q", lock_duration=timedelta(seconds=2), enable_partitioning=False)
    _send(ns, [Message(f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("q", prefetch_count=5) as r:
        (first,) = r.receive_messages(max_message_count=1, max_wait_time=2)
        assert first.locked_until_utc is not None
        sleep_past(first.locked_until_utc)
        rest = r.receive_messages(max_message_count=3, max_wait_time=2)
        now = datetime.now(UTC)
        assert rest
        for m in rest:
            assert m.locked_until_utc is not None and m.locked_until_utc > now
            assert m.delivery_count == 1


def test_peek_browses_without_locking(ns: Namespace) -> None:
    """peek_messages returns messages without a lock, does not count a delivery, and leaves them receivable."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("q") as r:
        peeked = peek_all(r)
        assert sorted(str(m) for m in peeked) == ["m0", "m1", "m2"]
        assert all(m.lock_token is None for m in peeked)
        assert all(m.delivery_count == 0 for m in peeked)
        got = drain(r, 3)
    assert sorted(m.sequence_number for m in got) == sorted(m.sequence_number for m in peeked)
    assert all(m.delivery_count == 0 for m in got)


def test_peek_includes_locked_deferred_and_scheduled_messages(ns: Namespace) -> None:
    """Peek shows locked, deferred and scheduled messages, with their state, and never exposes a lock token."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("locked"), Message("deferred"), Message("free")])
        s.schedule_messages(Message("scheduled"), datetime.now(UTC) + timedelta(minutes=10))
    with ns.get_queue_receiver("q") as r:
        locked, deferred = r.receive_messages(max_message_count=2, max_wait_time=2)
        r.defer_message(deferred)
        with ns.get_queue_receiver("q") as browser:
            peeked = {str(m): m for m in peek_all(browser)}
        assert set(peeked) == {"locked", "deferred", "free", "scheduled"}
        assert peeked["deferred"].state == "deferred"
        assert peeked["scheduled"].state == "scheduled"
        assert peeked["free"].state == "active"
        assert peeked["locked"].state == "active"
        assert all(m.lock_token is None for m in peeked.values())
        r.complete_message(locked)


def test_peek_continues_where_the_last_call_stopped(ns: Namespace) -> None:
    """Successive peeks continue: together they return every message once, then []."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}", partition_key=f"k{i % 5}") for i in range(20)])
    with ns.get_queue_receiver("q") as r:
        seen: list[int] = []
        for _ in range(40):
            got = r.peek_messages(3)
            if not got:
                break
            assert len(got) <= 3
            seen.extend(m.sequence_number for m in got)
        assert r.peek_messages(3) == []
    assert len(seen) == 20
    assert len(set(seen)) == 20


def test_peek_from_a_sequence_number(ns: Namespace) -> None:
    """peek_messages(sequence_number=s) starts at s, in sequence order."""
    ns.create_queue("q", enable_partitioning=False)
    seqs = _send(ns, [Message(f"m{i}") for i in range(6)])
    with ns.get_queue_receiver("q") as r:
        got = r.peek_messages(10, sequence_number=seqs[2])
        got += r.peek_messages(10)
        assert [m.sequence_number for m in got] == seqs[2:]
        again = r.peek_messages(2, sequence_number=seqs[0])
    assert [m.sequence_number for m in again] == seqs[:2]


def test_peeking_page_by_page_from_the_last_number_sees_every_message_once(ns: Namespace) -> None:
    """The SDK's browse loop, peek_messages(k, sequence_number=last.sequence_number + 1), on a partitioned queue:
    a number starts the browse at that message, and the pages cover every message once, in sequence order."""
    ns.create_queue("q")
    seqs = _send(ns, [Message(f"m{i}", partition_key=key_for_partition(i % 16, f"k{i}")) for i in range(40)])
    with ns.get_queue_receiver("q") as r:
        (top,) = r.peek_messages(1, sequence_number=max(seqs))
        assert top.sequence_number == max(seqs)
        seen = []
        page = r.peek_messages(3, sequence_number=0)
        while page:
            seen += [m.sequence_number for m in page]
            page = r.peek_messages(3, sequence_number=page[-1].sequence_number + 1)
    assert seen == sorted(seqs)


def test_iterating_a_receiver_yields_messages_and_ends(ns: Namespace) -> None:
    """`for m in receiver` yields the available messages and stops after max_wait_time with none."""
    ns.create_queue("q")
    _send(ns, [Message(f"m{i}") for i in range(5)])
    got = []
    with ns.get_queue_receiver("q", max_wait_time=0.5) as r:
        for m in r:
            got.append(str(m))
            r.complete_message(m)
    assert sorted(got) == [f"m{i}" for i in range(5)]
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_receive_skips_an_unavailable_partition(ns: Namespace) -> None:
    """Receives skip an unavailable partition and return the messages of the others."""
    ns.create_queue("q")
    down, up = key_for_partition(4, "d"), key_for_partition(10, "u")
    _send(ns, [Message("down", partition_key=down), Message("up", partition_key=up)])
    faults = ns.fault_injector("q")
    faults.fail(4, ("read", "write"))
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in drain_all(r)] == ["up"]
        faults.heal()
        assert [str(m) for m in drain_all(r)] == ["down"]


def test_peek_reports_a_partition_whose_data_file_is_gone_where_receive_skips_it(ns: Namespace, root: str) -> None:
    """Real damage (a live data file deleted): receives skip the partition and read the others, but a browse must not
    skip messages silently (it returned ["up"] as if "down" did not exist): it raises PartitionUnavailableError."""
    ns.create_queue("q")
    down, up = key_for_partition(4, "d"), key_for_partition(10, "u")
    _send(ns, [Message("down", partition_key=down), Message("up", partition_key=up)])
    (lost,) = glob.glob(f"{root}/entities/*/partition_id=4/*.parquet")
    os.unlink(lost)
    with Namespace(root) as other, other.get_queue_receiver("q") as r:  # a handle that never read the file
        with pytest.raises(PartitionUnavailableError, match=r"partition\(s\) 4 of 'q'.*missing"):
            r.peek_messages(10)
        assert [str(m) for m in drain_all(r)] == ["up"]
        assert other.get_queue_runtime_properties("q").availability_status == "Limited"


def test_receiver_on_a_closed_receiver_fails(ns: Namespace) -> None:
    """A closed receiver refuses further receives."""
    ns.create_queue("q")
    r = ns.get_queue_receiver("q")
    r.close()
    with pytest.raises(InvalidOperationError):
        r.receive_messages()


def test_a_receive_returns_a_partition_in_sequence_order_when_a_later_round_takes_an_earlier_message(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round two of one receive (after an expired message) took A, whose lock had lapsed meanwhile, and returned it last."""
    from sparkqueue.model import lifecycle

    ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=1), dead_lettering_on_message_expiration=True)
    _send(ns, [Message("A"), Message("B"), Message("C", time_to_live=timedelta(milliseconds=300)), Message("D")])
    with ns.get_queue_receiver("q") as other:
        (held,) = other.receive_messages(1)  # A, locked for a second
    assert str(held) == "A"
    time.sleep(0.4)  # C has expired; A is still locked
    real, calls = lifecycle.deliver, []

    def deliver_then_wait(*args: object, **kwargs: object) -> lifecycle.Delivery:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        if not calls:  # the first round: B and D delivered, C expired; A's lock lapses before the second
            sleep_past(held.locked_until_utc)
        calls.append(out)
        return out

    monkeypatch.setattr(lifecycle, "deliver", deliver_then_wait)
    with ns.get_queue_receiver("q") as r:
        got = [str(m) for m in r.receive_messages(3)]
    assert len(calls) == 2 and got == ["A", "B", "D"]
