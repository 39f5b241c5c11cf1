"""Transactions (docs/semantics.md §7): sends and settlements on one entity and one partition key take effect
together at the end of `with ns.transaction():`, or not at all. Killed-process atomicity is in
test_sessions_concurrency.py."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from sparkqueue import Message, Namespace, ReceivedMessage, SqlRuleFilter, SubQueue
from sparkqueue.errors import InvalidOperationError, MessageAlreadySettled, MessageLockLostError, SessionLockLostError
from sparkqueue.receiver import Receiver

PARTITIONS = 16


# ---- helpers ---------------------------------------------------------------------------------


def _peek_ids(ns: Namespace, queue: str = "q", sub_queue: SubQueue | None = None) -> list[str]:
    """Ids of every stored message (browsing loops until a peek returns none, as docs/semantics.md §5 asks)."""
    with ns.get_queue_receiver(queue, sub_queue=sub_queue) as r:
        out = r.peek_messages(100, sequence_number=0)
        while True:
            got = r.peek_messages(100)
            if not got:
                break
            out.extend(got)
    return sorted(m.message_id for m in out if m.message_id is not None)


def _take(receiver: Receiver, expected: int, timeout_s: float = 10.0) -> list[ReceivedMessage]:
    out: list[ReceivedMessage] = []
    give_up = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < give_up:
        out.extend(receiver.receive_messages(max_message_count=expected - len(out), max_wait_time=0.2))
    return out


def _msgs(prefix: str, n: int, **kw: object) -> list[Message]:
    return [Message(f"{prefix}{i}", message_id=f"{prefix}{i}", **kw) for i in range(n)]  # type: ignore[arg-type]


def _keys_in_different_partitions() -> tuple[str, str]:
    from sparkqueue.model.partitioning import partition_for_key

    first = "k-0"
    for i in range(1, 1000):
        if partition_for_key(f"k-{i}", PARTITIONS) != partition_for_key(first, PARTITIONS):
            return first, f"k-{i}"
    raise AssertionError("no two keys in different partitions")


def _key_beside(key: str, prefix: str) -> str:
    """Another key (starting with `prefix`) that selects the same partition as `key`."""
    from sparkqueue.model.partitioning import partition_for_key

    home = partition_for_key(key, PARTITIONS)
    return next(f"{prefix}{i}" for i in range(10_000) if partition_for_key(f"{prefix}{i}", PARTITIONS) == home)


def _sleep_past(until: datetime, margin_s: float = 0.25) -> None:
    wait = (until - datetime.now(UTC)).total_seconds() + margin_s
    if wait > 0:
        time.sleep(wait)


@pytest.fixture
def q(ns: Namespace) -> Namespace:
    """A partitioned queue 'q' with one message 'm0' (partition key 'k') ready to be received."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key="k"))
    return ns


# ---- commit --------------------------------------------------------------------------------------


def test_sends_and_settlement_commit_together(q: Namespace) -> None:
    """Sends and a completion in one transaction all take effect at the end of the block."""
    ns = q
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with ns.transaction():
            assert s.send_messages(_msgs("out", 2, partition_key="k")) == []
            s.send_messages(Message("out2", message_id="out2", partition_key="k"))
            r.complete_message(m0)
        assert _peek_ids(ns) == ["out0", "out1", "out2"]
        got = _take(r, 3)
        assert sorted(m.message_id for m in got) == ["out0", "out1", "out2"]
        assert len({m.sequence_number >> 48 for m in got}) == 1


def test_commit_returns_sequence_numbers(q: Namespace) -> None:
    """The transaction's commit stores the sends with fresh, increasing sequence numbers in the key's partition."""
    ns = q
    with ns.get_queue_sender("q") as s:
        (before,) = s.send_messages(Message("pre", message_id="pre", partition_key="k"))
        with ns.transaction():
            s.send_messages(_msgs("t", 3, partition_key="k"))
        (after,) = s.send_messages(Message("post", message_id="post", partition_key="k"))
    with ns.get_queue_receiver("q") as r:
        seqs = {m.message_id: m.sequence_number for m in r.peek_messages(10, sequence_number=0)}
    assert before < seqs["t0"] < seqs["t1"] < seqs["t2"] < after
    assert {s >> 48 for s in seqs.values()} == {before >> 48}


@pytest.mark.parametrize("op", ["abandon", "defer", "dead_letter"])
def test_other_settlements_apply_at_commit(q: Namespace, op: str) -> None:
    """Abandon, defer and dead-letter recorded in a transaction apply at its end, with the sends."""
    ns = q
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with ns.transaction():
            s.send_messages(Message("x", message_id="x", partition_key="k"))
            if op == "dead_letter":
                r.dead_letter_message(m0, reason="why", error_description="because")
            else:
                getattr(r, f"{op}_message")(m0)
        rp = ns.get_queue_runtime_properties("q")
        if op == "abandon":
            assert sorted(m.message_id for m in _take(r, 2)) == ["m0", "x"]
        elif op == "defer":
            assert rp.deferred_message_count == 1
            (d,) = r.receive_deferred_messages(m0.sequence_number)
            assert d.message_id == "m0"
        else:
            assert rp.dead_letter_message_count == 1
            with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
                (d,) = _take(dlq, 1)
                assert (d.message_id, d.dead_letter_reason) == ("m0", "why")
        assert "x" in _peek_ids(ns)


def test_nothing_is_visible_before_the_commit(q: Namespace) -> None:
    """Inside the block, other receivers see neither the sends nor the settlement; after it they see both."""
    ns = q
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with ns.transaction():
            s.send_messages(_msgs("new", 3, partition_key="k"))
            r.complete_message(m0)
            with Namespace(ns.root) as other, other.get_queue_receiver("q") as watcher:
                assert [m.message_id for m in watcher.peek_messages(10, sequence_number=0)] == ["m0"]
                assert watcher.receive_messages(max_message_count=5, max_wait_time=0.3) == []
            assert ns.get_queue_runtime_properties("q").total_message_count == 1
        assert _peek_ids(ns) == ["new0", "new1", "new2"]


def test_sends_take_effect_at_the_commit(q: Namespace) -> None:
    """A transaction's messages are enqueued when it commits: their enqueue time and expiry count from then.

    A scheduled message still becomes visible at its scheduled time.
    """
    ns = q
    later = datetime.now(UTC) + timedelta(hours=1)
    with ns.get_queue_sender("q") as s, ns.transaction():
        s.send_messages(Message("ttl", message_id="ttl", partition_key="k", time_to_live=timedelta(seconds=30)))
        s.send_messages(Message("sch", message_id="sch", partition_key="k", scheduled_enqueue_time_utc=later))
        time.sleep(0.3)
        with Namespace(ns.root) as other:  # another namespace's send is applied at once
            other.get_queue_sender("q").send_messages(Message("other", message_id="other"))
        before_commit = datetime.now(UTC)
    with ns.get_queue_receiver("q") as r:
        got = {m.message_id: m for m in r.peek_messages(10, sequence_number=0)}
    assert got["ttl"].enqueued_time_utc >= max(before_commit, got["other"].enqueued_time_utc)
    assert got["ttl"].expires_at_utc == got["ttl"].enqueued_time_utc + timedelta(seconds=30)
    assert got["sch"].enqueued_time_utc == later


def test_empty_transaction_is_a_no_op(q: Namespace) -> None:
    """A transaction with no operations commits nothing and raises nothing."""
    ns = q
    with ns.transaction():
        pass
    assert _peek_ids(ns) == ["m0"]


def test_a_transaction_commits_once(q: Namespace) -> None:
    """commit() inside the block finishes the transaction: the exit commits nothing again, nothing more is
    recorded, and a commit of a finished transaction raises."""
    ns = q
    with ns.get_queue_sender("q") as s:
        with ns.transaction() as tx:
            s.send_messages(Message("x", message_id="x", partition_key="k"))
            assert len(tx.commit()) == 1
            with pytest.raises(InvalidOperationError, match="already finished"):
                s.send_messages(Message("y", message_id="y", partition_key="k"))
        with pytest.raises(InvalidOperationError, match="already finished"):
            tx.commit()
        with ns.transaction() as tx2:
            s.send_messages(Message("z", message_id="z", partition_key="k"))
        with pytest.raises(InvalidOperationError, match="already finished"):
            tx2.commit()
    assert _peek_ids(ns) == ["m0", "x", "z"]


# ---- nothing applied --------------------------------------------------------------------------------


def test_exception_in_block_applies_nothing(q: Namespace) -> None:
    """An exception inside the block discards the transaction: no send, no settlement."""
    ns = q
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with pytest.raises(RuntimeError, match="boom"), ns.transaction():
            s.send_messages(_msgs("new", 3, partition_key="k"))
            r.complete_message(m0)
            raise RuntimeError("boom")
        assert _peek_ids(ns) == ["m0"]
        r.complete_message(m0)  # the lock was never consumed by the discarded transaction
    assert _peek_ids(ns) == []


def test_expired_lock_at_commit_applies_nothing(ns: Namespace) -> None:
    """A settled message whose lock expired before the commit: MessageLockLostError, and nothing applied."""
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key="k"))
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with pytest.raises(MessageLockLostError), ns.transaction():
            s.send_messages(Message("new", message_id="new", partition_key="k"))
            r.complete_message(m0)  # recorded while the lock holds; it expires before the commit
            assert m0.locked_until_utc is not None
            _sleep_past(m0.locked_until_utc)
        assert _peek_ids(ns) == ["m0"]
        assert ns.get_queue_runtime_properties("q").total_message_count == 1


def test_superseded_lock_at_commit_applies_nothing(ns: Namespace) -> None:
    """A settled message redelivered to another receiver before the commit: MessageLockLostError, nothing applied."""
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key="k"))
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s, ns.get_queue_receiver("q") as thief:
        (m0,) = _take(r, 1)
        with pytest.raises(MessageLockLostError), ns.transaction():
            s.send_messages(Message("new", message_id="new", partition_key="k"))
            r.complete_message(m0)
            assert m0.locked_until_utc is not None
            _sleep_past(m0.locked_until_utc)
            (stolen,) = _take(thief, 1)
            assert stolen.delivery_count == 1
        assert _peek_ids(ns) == ["m0"]
        thief.complete_message(stolen)  # the thief's lock is intact
    assert _peek_ids(ns) == []


def test_a_failed_commit_finishes_the_transaction(ns: Namespace) -> None:
    """A commit that failed is not tried again with the old operations: entering or committing it again raises."""
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key="k"))
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        tx = ns.transaction()
        with pytest.raises(MessageLockLostError), tx:
            s.send_messages(Message("n", message_id="n", partition_key="k"))
            r.complete_message(m0)
            _sleep_past(m0.locked_until_utc)
        with pytest.raises(InvalidOperationError, match="already finished"), tx:
            pass
        with pytest.raises(InvalidOperationError, match="already finished"):
            tx.commit()
    assert _peek_ids(ns) == ["m0"]


def test_a_dead_letter_settled_through_the_main_receiver_applies_nothing(q: Namespace) -> None:
    """A transaction settles only rows of each receiver's sub-queue: a dead letter completed through the main queue's
    receiver raises MessageLockLostError at the commit, and nothing (not even the send) is applied."""
    ns = q
    with (
        ns.get_queue_receiver("q") as main,
        ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq,
        ns.get_queue_sender("q") as s,
    ):
        main.dead_letter_message(_take(main, 1)[0])
        (dead,) = _take(dlq, 1)
        with pytest.raises(MessageLockLostError), ns.transaction():
            s.send_messages(Message("new", message_id="new", partition_key="k"))
            main.complete_message(dead)
        assert _peek_ids(ns) == [] and _peek_ids(ns, sub_queue=SubQueue.DEAD_LETTER) == ["m0"]
        with ns.transaction():
            dlq.complete_message(dead)  # its own receiver still holds the lock
    assert _peek_ids(ns, sub_queue=SubQueue.DEAD_LETTER) == []


def test_failed_transaction_can_be_retried(q: Namespace) -> None:
    """After a discarded transaction the same operations succeed in a new one."""
    ns = q
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with pytest.raises(ValueError), ns.transaction():
            s.send_messages(Message("n", message_id="n", partition_key="k"))
            raise ValueError
        with ns.transaction():
            s.send_messages(Message("n", message_id="n", partition_key="k"))
            r.complete_message(m0)
    assert _peek_ids(ns) == ["n"]


# ---- InvalidOperationError rules -----------------------------------------------------------------------


def test_message_without_partition_key_is_refused(q: Namespace) -> None:
    """A message with no partition key (no session, no partition_key) in a transaction raises; nothing is applied."""
    ns = q
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidOperationError), ns.transaction():
        s.send_messages(Message("keyed", message_id="keyed", partition_key="k"))
        s.send_messages(Message("unkeyed", message_id="unkeyed"))
    assert _peek_ids(ns) == ["m0"]


def test_message_id_is_not_a_key_without_duplicate_detection(q: Namespace) -> None:
    """On an entity without duplicate detection a message_id does not count as a partition key."""
    ns = q
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidOperationError), ns.transaction():
        s.send_messages(Message("x", message_id="only-an-id"))
    assert _peek_ids(ns) == ["m0"]


def test_message_id_is_the_key_with_duplicate_detection(ns: Namespace) -> None:
    """On a duplicate-detecting entity the message_id is the key; a second id is a second key and is refused."""
    ns.create_queue("dd", requires_duplicate_detection=True)
    with ns.get_queue_sender("dd") as s:
        with ns.transaction():
            s.send_messages(Message("x", message_id="id-1"))
            s.send_messages(Message("x again", message_id="id-1"))  # same key; dropped as a duplicate
        with pytest.raises(InvalidOperationError), ns.transaction():
            s.send_messages(Message("y", message_id="id-2"))
            s.send_messages(Message("z", message_id="id-3"))
    assert _peek_ids(ns, "dd") == ["id-1"]


def test_different_partition_keys_are_refused(q: Namespace) -> None:
    """All messages of a transaction must share one partition key, even keys that map to one partition."""
    from sparkqueue.model.partitioning import partition_for_key

    ns = q
    home = partition_for_key("k", PARTITIONS)
    same = next(f"k2-{i}" for i in range(10_000) if partition_for_key(f"k2-{i}", PARTITIONS) == home)
    with ns.get_queue_sender("q") as s:
        for other in (same, "elsewhere"):
            with pytest.raises(InvalidOperationError), ns.transaction():
                s.send_messages(Message("a", message_id="a", partition_key="k"))
                s.send_messages(Message("b", message_id="b", partition_key=other))
        with pytest.raises(InvalidOperationError), ns.transaction():
            s.send_messages([Message("a", message_id="a", partition_key="k"), Message("b", message_id="b", partition_key="k-x")])
    assert _peek_ids(ns) == ["m0"]


def test_different_sessions_are_refused(ns: Namespace) -> None:
    """The messages of a transaction may not belong to different sessions."""
    ns.create_queue("sq", requires_session=True)
    ns.create_queue("plain")
    with ns.get_queue_sender("sq") as s, pytest.raises(InvalidOperationError), ns.transaction():
        s.send_messages(Message("a", session_id="s1"))
        s.send_messages(Message("b", session_id="s2"))
    # the same key, but one message in a session and one not
    with ns.get_queue_sender("plain") as s, pytest.raises(InvalidOperationError), ns.transaction():
        s.send_messages(Message("a", session_id="x"))
        s.send_messages(Message("b", partition_key="x"))
    assert ns.get_queue_runtime_properties("sq").total_message_count == 0
    assert ns.get_queue_runtime_properties("plain").total_message_count == 0


def test_settled_messages_of_another_session_or_key_are_refused(ns: Namespace) -> None:
    """A settled message counts as a message of the transaction: its session and partition key must be the ones the
    transaction sends with (in either order), even when both select one partition; nothing is applied."""
    ns.create_queue("sq", requires_session=True)
    ns.create_queue("q")
    other_session, other_key = _key_beside("s1", "s-"), _key_beside("k", "k-")
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("a", message_id="a", session_id="s1"))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("b", message_id="b", partition_key="k"))
    cases = [
        ("sq", ns.get_queue_receiver("sq", session_id="s1"), Message("x", message_id="x", session_id=other_session)),
        ("q", ns.get_queue_receiver("q"), Message("x", message_id="x", partition_key=other_key)),
        ("q", ns.get_queue_receiver("q"), Message("x", message_id="x", session_id="k")),  # same key, in a session
    ]
    for queue, receiver, message in cases:
        with receiver as r, ns.get_queue_sender(queue) as s:
            (m,) = _take(r, 1)
            with pytest.raises(InvalidOperationError), ns.transaction():
                r.complete_message(m)
                s.send_messages(message)
            with pytest.raises(InvalidOperationError), ns.transaction():
                s.send_messages(message)
                r.complete_message(m)
            r.abandon_message(m)  # still locked by us: the transactions recorded nothing
    assert ns.get_queue_runtime_properties("sq").total_message_count == 1
    assert _peek_ids(ns, "q") == ["b"]


def test_one_session_transaction_commits(ns: Namespace) -> None:
    """Several messages of one session in one transaction are stored together, in order."""
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("sq") as s, ns.transaction():
        s.send_messages([Message(f"m{i}", session_id="s1", message_id=f"m{i}") for i in range(5)])
    with ns.get_queue_receiver("sq", session_id="s1") as r:
        got = _take(r, 5)
    assert [m.message_id for m in got] == [f"m{i}" for i in range(5)]


def test_two_entities_are_refused(ns: Namespace) -> None:
    """A transaction acts on one entity: touching a second raises, and nothing is applied."""
    ns.create_queue("a")
    ns.create_queue("b")
    with ns.get_queue_sender("a") as sa, ns.get_queue_sender("b") as sb, pytest.raises(InvalidOperationError), ns.transaction():
        sa.send_messages(Message("1", partition_key="k"))
        sb.send_messages(Message("2", partition_key="k"))
    assert ns.get_queue_runtime_properties("a").total_message_count == 0
    assert ns.get_queue_runtime_properties("b").total_message_count == 0


def test_a_refused_operation_does_not_bind_the_transaction_to_its_entity(ns: Namespace) -> None:
    """A refused call changes nothing: an unkeyed send to "b" (refused) leaves the transaction free to act on "a"."""
    ns.create_queue("a")
    ns.create_queue("b")
    with ns.get_queue_sender("a") as sa, ns.get_queue_sender("b") as sb, ns.transaction():
        with pytest.raises(InvalidOperationError, match="partition key"):
            sb.send_messages(Message("unkeyed", message_id="unkeyed"))
        sa.send_messages(Message("kept", message_id="kept", partition_key="k"))
    assert _peek_ids(ns, "a") == ["kept"]
    assert ns.get_queue_runtime_properties("b").total_message_count == 0


def test_one_queue_named_in_two_cases_is_one_entity(ns: Namespace) -> None:
    """Names ignore case (docs/semantics.md §1): a settlement through "Q" and a send through "q" commit together."""
    ns.create_queue("Q")
    with ns.get_queue_sender("Q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key="k"))
    with ns.get_queue_receiver("Q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with ns.transaction():
            r.complete_message(m0)
            s.send_messages(Message("n", message_id="n", partition_key="k"))
    assert _peek_ids(ns, "Q") == ["n"]


def test_settled_message_outside_the_keys_partition_is_refused(ns: Namespace) -> None:
    """Settled messages must be in the partition of the transaction's key; otherwise nothing is applied."""
    k1, k2 = _keys_in_different_partitions()
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m0", message_id="m0", partition_key=k1))
    with ns.get_queue_receiver("q") as r, ns.get_queue_sender("q") as s:
        (m0,) = _take(r, 1)
        with pytest.raises(InvalidOperationError), ns.transaction():
            r.complete_message(m0)
            s.send_messages(Message("n", message_id="n", partition_key=k2))
        assert _peek_ids(ns) == ["m0"]
        r.complete_message(m0)  # still locked by us: the transaction did nothing


def test_settlements_across_partitions_are_refused(ns: Namespace) -> None:
    """Messages settled in one transaction must all be in one partition."""
    k1, k2 = _keys_in_different_partitions()
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("a", message_id="a", partition_key=k1))
        s.send_messages(Message("b", message_id="b", partition_key=k2))
    with ns.get_queue_receiver("q") as r:
        got = _take(r, 2)
        with pytest.raises(InvalidOperationError), ns.transaction():
            for m in got:
                r.complete_message(m)
        assert _peek_ids(ns) == ["a", "b"]


def test_rule_changes_are_refused_inside_a_transaction(ns: Namespace) -> None:
    """create_rule and delete_rule raise InvalidOperationError inside a transaction and change nothing."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError), ns.transaction():
        ns.create_rule("t", "s", "r1", filter=SqlRuleFilter("1 = 1"))
    with pytest.raises(InvalidOperationError), ns.transaction():
        ns.delete_rule("t", "s", "$Default")
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def test_lock_renewal_and_nesting_are_refused(q: Namespace) -> None:
    """Inside a transaction, renew_message_lock and a nested transaction raise InvalidOperationError."""
    ns = q
    with ns.get_queue_receiver("q") as r:
        (m0,) = _take(r, 1)
        with pytest.raises(InvalidOperationError), ns.transaction():
            r.renew_message_lock(m0)
        with pytest.raises(InvalidOperationError), ns.transaction(), ns.transaction():
            pass
        r.complete_message(m0)


def test_at_most_100_messages(q: Namespace) -> None:
    """A transaction holds at most 100 messages (sends and settlements together); 100 commit, 101 are refused."""
    ns = q
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError), ns.transaction():
            s.send_messages(_msgs("over", 101, partition_key="k"))
        with pytest.raises(InvalidOperationError), ns.transaction():
            s.send_messages(_msgs("over", 60, partition_key="k"))
            s.send_messages(_msgs("more", 41, partition_key="k"))
        assert _peek_ids(ns) == ["m0"]
        with ns.get_queue_receiver("q") as r:
            (m0,) = _take(r, 1)
            with pytest.raises(InvalidOperationError), ns.transaction():
                r.complete_message(m0)
                s.send_messages(_msgs("x", 100, partition_key="k"))
            assert _peek_ids(ns) == ["m0"]
            with ns.transaction():
                r.complete_message(m0)
                s.send_messages(_msgs("x", 99, partition_key="k"))
    assert len(_peek_ids(ns)) == 99
    with ns.get_queue_sender("q") as s, ns.transaction():
        s.send_messages(_msgs("full", 100, partition_key="k2"))
    assert len(_peek_ids(ns)) == 199


def test_finished_transaction_records_nothing_more(q: Namespace) -> None:
    """After its block ends, sends are applied directly again (no transaction stays open in the thread)."""
    ns = q
    with ns.get_queue_sender("q") as s:
        with ns.transaction():
            s.send_messages(Message("in", message_id="in", partition_key="k"))
        seqs = s.send_messages(Message("after", message_id="after"))
    assert len(seqs) == 1
    assert _peek_ids(ns) == ["after", "in", "m0"]


def test_a_finished_transaction_cannot_be_entered_again(q: Namespace) -> None:
    """Entering a finished transaction again is refused: its sends were applied once and are not applied twice."""
    ns = q
    with ns.get_queue_sender("q") as s:
        tx = ns.transaction()
        with tx:
            s.send_messages(Message("once", message_id="once", partition_key="k"))
        with pytest.raises(InvalidOperationError, match="already finished"), tx:
            pass
    assert _peek_ids(ns) == ["m0", "once"]


def test_a_message_settled_twice_in_one_transaction_is_refused(q: Namespace) -> None:
    """A second settlement of one message in a transaction raises MessageAlreadySettled; the first applies at commit."""
    ns = q
    with ns.get_queue_receiver("q") as r:
        (m0,) = _take(r, 1)
        with ns.transaction():
            r.complete_message(m0)
            with pytest.raises(MessageAlreadySettled, match="already settled in this transaction"):
                r.dead_letter_message(m0, reason="x")
    props = ns.get_queue_runtime_properties("q")
    assert (props.total_message_count, props.dead_letter_message_count) == (0, 0)


def test_an_operation_past_the_limit_is_not_recorded(q: Namespace) -> None:
    """The operation that would pass 100 is refused and left out: a caller that goes on commits the rest only."""
    ns = q
    with ns.get_queue_sender("q") as s, ns.get_queue_receiver("q") as r:
        (m0,) = _take(r, 1)
        with ns.transaction():
            s.send_messages(_msgs("x", 100, partition_key="k"))
            with pytest.raises(InvalidOperationError, match="at most 100"):
                r.complete_message(m0)
            with pytest.raises(InvalidOperationError, match="at most 100"):
                s.send_messages(Message("y", message_id="y", partition_key="k"))
    assert sorted(_peek_ids(ns)) == sorted(["m0", *(f"x{i}" for i in range(100))])  # m0 not completed, y not sent


# ---- topics and sessions --------------------------------------------------------------------------------


def test_topic_send_in_a_transaction_reaches_subscriptions(ns: Namespace) -> None:
    """Messages sent to a topic in a transaction are copied to the matching subscriptions at commit."""
    ns.create_topic("t")
    ns.create_subscription("t", "all")
    ns.create_subscription("t", "none")
    ns.delete_rule("t", "none", "$Default")
    ns.create_rule("t", "none", "never", filter=SqlRuleFilter("1 = 0"))
    with ns.get_topic_sender("t") as s, ns.transaction():
        s.send_messages(_msgs("t", 3, partition_key="k"))
    with ns.get_subscription_receiver("t", "all") as r:
        got = _take(r, 3)
    assert sorted(m.message_id for m in got) == ["t0", "t1", "t2"]
    assert ns.get_subscription_runtime_properties("t", "none").total_message_count == 0


def test_session_receiver_settles_in_a_transaction(ns: Namespace) -> None:
    """A session receiver's completion and a send to its session commit together."""
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("m0", session_id="s1", message_id="m0"))
    with ns.get_queue_receiver("sq", session_id="s1") as r, ns.get_queue_sender("sq") as s:
        (m0,) = _take(r, 1)
        with ns.transaction():
            r.complete_message(m0)
            s.send_messages(Message("m1", session_id="s1", message_id="m1"))
        (m1,) = _take(r, 1)
        assert m1.message_id == "m1"
        r.complete_message(m1)
    assert ns.get_queue_runtime_properties("sq").total_message_count == 0


def test_session_transaction_with_lost_session_lock_applies_nothing(ns: Namespace) -> None:
    """A session transaction whose session lock expired before the commit raises SessionLockLostError; nothing applied."""
    ns.create_queue("sq", requires_session=True, lock_duration=timedelta(seconds=2))
    with ns.get_queue_sender("sq") as s:
        s.send_messages(Message("m0", session_id="s1", message_id="m0"))
    with ns.get_queue_receiver("sq", session_id="s1") as r, ns.get_queue_sender("sq") as s:
        assert r.session is not None
        (m0,) = _take(r, 1)
        with pytest.raises(SessionLockLostError), ns.transaction():
            r.complete_message(m0)
            s.send_messages(Message("m1", session_id="s1", message_id="m1"))
            _sleep_past(r.session.locked_until_utc)
    assert [x.session_id for x in ns.list_queue_sessions("sq")] == ["s1"]
    assert ns.list_queue_sessions("sq")[0].active_message_count == 1


# ---- where the open transaction lives (a ContextVar: docs/semantics.md §7) ------------------------------


def test_a_transaction_does_not_capture_another_threads_sends(q: Namespace) -> None:
    """While a transaction is open in one thread, a send from another thread is applied at once."""
    import threading

    ns = q
    seen: list[list[str]] = []
    with ns.get_queue_sender("q") as s, ns.transaction():
        s.send_messages(Message("in", message_id="in", partition_key="k"))
        worker = threading.Thread(target=lambda: s.send_messages(Message("other", message_id="other")))
        worker.start()
        worker.join()
        seen.append(_peek_ids(ns))
    assert seen == [["m0", "other"]]  # the other thread's send was visible before the commit; "in" was not
    assert _peek_ids(ns) == ["in", "m0", "other"]


def test_a_transaction_does_not_capture_another_namespaces_sends(q: Namespace) -> None:
    """A transaction belongs to its namespace: a second namespace on the same root sends directly inside the block."""
    ns = q
    other = Namespace(ns.root)
    with ns.transaction(), ns.get_queue_sender("q") as s, other.get_queue_sender("q") as s2:
        s.send_messages(Message("in", message_id="in", partition_key="k"))
        assert len(s2.send_messages(Message("direct", message_id="direct"))) == 1
        assert _peek_ids(ns) == ["direct", "m0"]
    assert _peek_ids(ns) == ["direct", "in", "m0"]


def test_a_dead_letter_in_a_transaction_is_forwarded_at_commit(ns: Namespace) -> None:
    """forward_dead_lettered_messages_to applies to a transaction's dead letters as soon as it commits."""
    ns.create_queue("dlq-target")
    ns.create_queue("q", forward_dead_lettered_messages_to="dlq-target")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("x", message_id="x", partition_key="k"))
    with ns.get_queue_receiver("q") as r:
        (m,) = _take(r, 1)
        with ns.transaction():
            r.dead_letter_message(m, reason="bad", error_description="why")
    assert _peek_ids(ns, "q", SubQueue.DEAD_LETTER) == []
    with ns.get_queue_receiver("dlq-target") as r:
        (got,) = _take(r, 1)
    assert (got.message_id, got.dead_letter_reason) == ("x", "bad")


def test_transactions_of_two_namespaces_are_open_together_and_commit_apart(q: Namespace, tmp_path) -> None:
    """Nesting is refused per namespace: a transaction on another namespace may be open at the same time."""
    ns = q
    other = Namespace(tmp_path / "other")
    other.create_queue("q")
    with ns.get_queue_sender("q") as s, other.get_queue_sender("q") as s2, ns.transaction():
        s.send_messages(Message("a", message_id="a", partition_key="k"))
        with other.transaction():
            s2.send_messages(Message("b", message_id="b", partition_key="k"))
            assert _peek_ids(other) == []
        assert _peek_ids(other) == ["b"]  # the inner one committed at its own exit
        assert _peek_ids(ns) == ["m0"]
    assert _peek_ids(ns) == ["a", "m0"]


def test_messages_settled_by_a_commit_count_as_settled_and_a_discarded_one_does_not(q: Namespace) -> None:
    """After the commit, settling the message again raises MessageAlreadySettled, as after a direct settle."""
    from sparkqueue.errors import MessageAlreadySettled

    ns = q
    with ns.get_queue_receiver("q") as r:
        (m0,) = _take(r, 1)
        with pytest.raises(RuntimeError), ns.transaction():
            r.complete_message(m0)
            raise RuntimeError("discard")
        with ns.transaction():
            r.complete_message(m0)  # the discarded transaction left it unsettled
        with pytest.raises(MessageAlreadySettled):
            r.complete_message(m0)
    assert _peek_ids(ns) == []


def test_a_session_message_abandoned_in_a_transaction_comes_back_before_later_ones(ns: Namespace) -> None:
    """An abandon applied by a commit rewinds the session receiver: the message is its next one again."""
    ns.create_queue("sq", requires_session=True)
    with ns.get_queue_sender("sq") as s:
        s.send_messages([Message(f"m{i}", session_id="s1", message_id=f"m{i}") for i in range(3)])
    with ns.get_queue_receiver("sq", session_id="s1") as r:
        (m0,) = r.receive_messages(1)
        with ns.transaction():
            r.abandon_message(m0)
        got = r.receive_messages(3)
        assert [m.message_id for m in got] == ["m0", "m1", "m2"]
        r.complete_messages(got)


def test_calls_a_rollback_could_not_undo_are_refused_inside_a_transaction(ns: Namespace) -> None:
    """set_state, session renew_lock and cancel_scheduled_messages applied at once and survived the rollback."""
    ns.create_queue("q", requires_session=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m", session_id="s"))
        (scheduled,) = s.schedule_messages(Message("later", session_id="s"), datetime.now(UTC) + timedelta(hours=1))
        with ns.get_queue_receiver("q", session_id="s") as r:
            r.session.set_state(b"before")
            with ns.transaction():
                with pytest.raises(InvalidOperationError, match="inside a transaction"):
                    r.session.set_state(b"after")
                with pytest.raises(InvalidOperationError, match="inside a transaction"):
                    r.session.renew_lock()
                with pytest.raises(InvalidOperationError, match="inside a transaction"):
                    s.cancel_scheduled_messages(scheduled)
            assert r.session.get_state() == b"before"
    assert ns.get_queue_runtime_properties("q").scheduled_message_count == 1


def test_one_transaction_entered_from_a_second_thread_is_refused(ns: Namespace) -> None:
    """Its exit there committed the first thread's recorded sends while that block was still open."""
    import threading

    ns.create_queue("q")
    tx = ns.transaction()
    errors: list[BaseException] = []

    def enter_again() -> None:
        try:
            with tx:
                pass
        except InvalidOperationError as exc:
            errors.append(exc)

    with ns.get_queue_sender("q") as s, tx:
        s.send_messages(Message("a", partition_key="k"))
        t = threading.Thread(target=enter_again)
        t.start()
        t.join()
        assert ns.get_queue_runtime_properties("q").total_message_count == 0  # nothing committed by the other thread
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert ns.get_queue_runtime_properties("q").total_message_count == 1
