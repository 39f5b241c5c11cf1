"""Sessions (docs/semantics.md §6, with §5 and §11): session-id sends, named and next-available session receivers,
the exclusive and expiring session lock, strict per-session FIFO, session state, listing, and
session-enabled subscriptions. Single-process rules; multi-process ones are in
test_sessions_concurrency.py."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from procs import renewing

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace, ReceivedMessage, ReceiveMode, SubQueue
from sparkqueue.errors import (
    InvalidOperationError,
    MessageLockLostError,
    MessageNotFoundError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
    SessionLockLostError,
)
from sparkqueue.receiver import Receiver

SHORT = timedelta(seconds=2)  # short, yet long enough for a loaded machine to act within one lock


# ---- helpers ---------------------------------------------------------------------------------


def _session_queue(ns: Namespace, name: str = "q", lock: timedelta | None = None, **kw: object) -> None:
    """Create a session-enabled queue (optionally with a short lock)."""
    if lock is not None:
        kw["lock_duration"] = lock
    ns.create_queue(name, requires_session=True, **kw)


def _send(ns: Namespace, session: str, bodies: list[str], queue: str = "q") -> list[int]:
    with ns.get_queue_sender(queue) as s:
        return s.send_messages([Message(b, session_id=session, message_id=b) for b in bodies])


def _take(receiver: Receiver, expected: int, timeout_s: float = 10.0) -> list[ReceivedMessage]:
    """Receive (one call at a time, up to `expected`) until `expected` arrived or the loop bound passed."""
    out: list[ReceivedMessage] = []
    give_up = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < give_up:
        out.extend(receiver.receive_messages(max_message_count=expected - len(out), max_wait_time=0.2))
    return out


def _consume_all(receiver: Receiver, idle_s: float = 0.3) -> list[ReceivedMessage]:
    """Receive and complete one message at a time until a receive that waited `idle_s` returns none."""
    out: list[ReceivedMessage] = []
    while True:
        got = receiver.receive_messages(max_message_count=1, max_wait_time=idle_s)
        if not got:
            return out
        for m in got:
            receiver.complete_message(m)
        out.extend(got)


def _sleep_past(until: datetime, margin_s: float = 0.25) -> None:
    """Sleep until a UTC instant has passed (plus a margin), so an expiry is certain, not raced."""
    wait = (until - datetime.now(UTC)).total_seconds() + margin_s
    if wait > 0:
        time.sleep(wait)


def _sessions(ns: Namespace, queue: str = "q") -> dict[str, object]:
    return {s.session_id: s for s in ns.list_queue_sessions(queue)}


# ---- sending ---------------------------------------------------------------------------------


def test_send_without_session_id_is_refused_and_stores_nothing(ns: Namespace) -> None:
    """A session-enabled queue refuses a message without session_id (InvalidOperationError), also inside a batch."""
    _session_queue(ns)
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError):
            s.send_messages(Message("no session"))
        with pytest.raises(InvalidOperationError):
            s.send_messages([Message("ok", session_id="s1"), Message("no session", partition_key="k")])
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert ns.list_queue_sessions("q") == []


def test_session_messages_share_the_partition_of_their_session(ns: Namespace) -> None:
    """All messages of one session land in one partition (the session id is the partition key)."""
    _session_queue(ns)
    seqs = _send(ns, "s-a", [f"a{i}" for i in range(5)]) + _send(ns, "s-a", ["a5"])
    assert len({s >> 48 for s in seqs}) == 1
    assert seqs == sorted(seqs)


# ---- accepting sessions ------------------------------------------------------------------------


def test_receiver_without_session_id_on_session_queue_is_refused(ns: Namespace) -> None:
    """A session-enabled queue is read through session receivers only; session_id on a plain queue is refused."""
    _session_queue(ns)
    ns.create_queue("plain")
    with pytest.raises(InvalidOperationError):
        ns.get_queue_receiver("q")
    with pytest.raises(InvalidOperationError):
        ns.get_queue_receiver("plain", session_id="s1")


def test_named_session_receiver_gets_only_its_session_in_order(ns: Namespace) -> None:
    """A receiver for a named session gets that session's messages only, in sequence order."""
    _session_queue(ns)
    for i in range(4):
        _send(ns, "s1", [f"s1-{i}"])
        _send(ns, "s2", [f"s2-{i}"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None and r.session.session_id == "s1"
        got = _take(r, 4)
        assert [m.message_id for m in got] == [f"s1-{i}" for i in range(4)]
        assert all(m.session_id == "s1" for m in got)
        assert [m.sequence_number for m in got] == sorted(m.sequence_number for m in got)
        for m in got:
            r.complete_message(m)
        assert r.receive_messages(max_message_count=5, max_wait_time=0.3) == []
    assert _sessions(ns)["s2"].active_message_count == 4


def test_named_session_can_be_accepted_before_it_has_messages(ns: Namespace) -> None:
    """Accepting a named session that has no messages yet succeeds; messages sent later reach its receiver."""
    _session_queue(ns)
    with ns.get_queue_receiver("q", session_id="later") as r:
        assert r.receive_messages(max_message_count=1, max_wait_time=0.2) == []
        _send(ns, "later", ["l0", "l1"])
        assert [m.message_id for m in _take(r, 2)] == ["l0", "l1"]


def test_next_available_session_locks_distinct_sessions_with_messages(ns: Namespace) -> None:
    """NEXT_AVAILABLE_SESSION locks a free session that has messages; a second one gets a different session."""
    _session_queue(ns)
    _send(ns, "a", ["a0", "a1"])
    _send(ns, "b", ["b0"])
    with ns.get_queue_receiver("q", session_id="empty"):
        pass  # a session that exists but has no messages is never chosen
    r1 = ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2)
    r2 = ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2)
    try:
        assert r1.session is not None and r2.session is not None
        assert {r1.session.session_id, r2.session.session_id} == {"a", "b"}
        for r in (r1, r2):
            got = _take(r, 2 if r.session.session_id == "a" else 1)
            assert {m.session_id for m in got} == {r.session.session_id}
        with pytest.raises(OperationTimeoutError):
            ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.3)
    finally:
        r1.close()
        r2.close()


def test_next_available_session_with_no_messages_times_out(ns: Namespace) -> None:
    """NEXT_AVAILABLE_SESSION on a queue with no messages raises OperationTimeoutError after max_wait_time (SDK pool loop)."""
    _session_queue(ns)
    with pytest.raises(OperationTimeoutError):
        ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.3)


def test_next_available_session_waits_for_a_session_to_arrive(ns: Namespace, root: str) -> None:
    """NEXT_AVAILABLE_SESSION with max_wait_time picks up a session whose first message arrives while it waits."""
    import threading

    _session_queue(ns)

    def late_send() -> None:
        time.sleep(0.5)
        with Namespace(root) as other:
            _send(other, "late", ["x"])

    t = threading.Thread(target=late_send)
    t.start()
    try:
        with ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=10) as r:
            assert r.session is not None and r.session.session_id == "late"
            assert [m.message_id for m in _take(r, 1)] == ["x"]
    finally:
        t.join()


def test_second_receiver_for_a_held_session_is_refused(ns: Namespace) -> None:
    """While one receiver holds a session, another receiver for it gets SessionCannotBeLockedError."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    with ns.get_queue_receiver("q", session_id="s1") as holder:
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        with Namespace(ns.root) as other, pytest.raises(SessionCannotBeLockedError):
            other.get_queue_receiver("q", session_id="s1")
        assert [m.message_id for m in _take(holder, 1)] == ["m0"]


def test_close_releases_the_session_and_its_message_locks_at_once(ns: Namespace) -> None:
    """Closing a session receiver releases the session lock and its messages' locks at once (no wait for expiry)."""
    _session_queue(ns)  # default lock_duration: 60 s, so only the release can free the session here
    _send(ns, "s1", ["m0", "m1"])
    first = ns.get_queue_receiver("q", session_id="s1")
    (m0,) = _take(first, 1)
    assert m0.delivery_count == 0
    first.close()
    assert _sessions(ns)["s1"].locked_until_utc is None
    with ns.get_queue_receiver("q", session_id="s1") as second:
        (again,) = _take(second, 1)
        assert again.message_id == "m0"
        assert again.delivery_count == 1
    with pytest.raises(InvalidOperationError):
        first.receive_messages()


def test_closing_the_namespace_closes_its_receivers_and_releases_their_locks(root: str) -> None:
    """Closing the namespace closes what it gave out (SDK: the client's close), so locks end at once, not at expiry."""
    ns = Namespace(root)
    _session_queue(ns)  # lock_duration 60 s: only a release frees them within the test
    ns.create_queue("plain")
    _send(ns, "s1", ["m0"])
    with ns.get_queue_sender("plain") as s:
        s.send_messages([Message("p0"), Message("p1")])
    sender = ns.get_queue_sender("q")
    session_receiver = ns.get_queue_receiver("q", session_id="s1")
    assert [m.message_id for m in _take(session_receiver, 1)] == ["m0"]
    prefetching = ns.get_queue_receiver("plain", prefetch_count=10)
    (first,) = prefetching.receive_messages(1, max_wait_time=5)  # the other message waits in its prefetch cache
    ns.close()
    for handler in (sender, session_receiver, prefetching):
        with pytest.raises(InvalidOperationError):
            handler.receive_messages() if isinstance(handler, Receiver) else handler.send_messages(Message("x"))
    with Namespace(root) as other:  # as another process would: nothing of the first namespace is held any more
        with other.get_queue_receiver("q", session_id="s1") as again:
            assert [(m.message_id, m.delivery_count) for m in _take(again, 1)] == [("m0", 1)]
        with other.get_queue_receiver("plain") as r:
            got = r.receive_messages(2, max_wait_time=1)  # the prefetched one only: the delivered one stays locked
            assert len(got) == 1 and got[0].message_id != first.message_id
    with ns.get_queue_receiver("plain") as r:  # the namespace itself works again after its close
        assert len(r.peek_messages(5)) == 2


def test_closed_receiver_cannot_settle_after_another_took_the_session(ns: Namespace) -> None:
    """After a session is released and accepted again, the earlier delivery's lock token settles nothing."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    first = ns.get_queue_receiver("q", session_id="s1")
    (m0,) = _take(first, 1)
    first.close()
    with ns.get_queue_receiver("q", session_id="s1") as second:
        (again,) = _take(second, 1)
        with pytest.raises(MessageLockLostError):
            second.complete_message(m0)  # the old delivery's token is not the current lock
        second.complete_message(again)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_a_closed_receivers_session_refuses_state_and_lock_calls(ns: Namespace) -> None:
    """After close, the session's calls raise InvalidOperationError (as the receiver's) and never lock it again."""
    _session_queue(ns)
    _send(ns, "s1", ["a"])
    r = ns.get_queue_receiver("q", session_id="s1")
    r.complete_message(_take(r, 1)[0])  # drained: still held until the close
    sess = r.session
    assert sess is not None
    r.close()
    for call in (lambda: sess.set_state(b"x"), sess.renew_lock, sess.get_state):
        with pytest.raises(InvalidOperationError):
            call()
    with ns.get_queue_receiver("q", session_id="s1") as r2:  # free at once: nothing re-locked it
        assert r2.session is not None and r2.session.get_state() is None
    _send(ns, "s2", ["b", "c"])
    r = ns.get_queue_receiver("q", session_id="s2")
    sess = r.session
    assert sess is not None
    r.close()
    with pytest.raises(InvalidOperationError):
        sess.set_state(b"x")
    with pytest.raises(SessionLockLostError):  # the model refuses a released lock too
        sess._sessions.renew(sess._lock)
    with ns.get_queue_receiver("q", session_id="s2") as r2:
        assert [m.message_id for m in _take(r2, 2)] == ["b", "c"]


def test_a_renewal_racing_close_never_locks_the_session_again(ns: Namespace) -> None:
    """A renewing thread (as an AutoLockRenewer's) racing close: the session is free right after close, every time."""
    _session_queue(ns, lock=timedelta(seconds=30))
    give_up = time.monotonic() + 4.0
    trials = 0
    while time.monotonic() < give_up or trials < 5:
        trials += 1
        _send(ns, "S", ["x"])
        r = ns.get_queue_receiver("q", session_id="S")
        r.complete_message(_take(r, 1)[0])  # drained but held: the close deletes the row, a late renewal must not keep it
        sess = r.session
        assert sess is not None
        stop = threading.Event()
        t = renewing(sess, stop)
        time.sleep(0.005 * (trials % 4))
        r.close()
        stop.set()
        t.join()
        ns.get_queue_receiver("q", session_id="S").close()  # SessionCannotBeLockedError if the renewal re-locked it


def test_peek_and_receive_deferred_after_the_session_lock_is_lost_raise_session_lock_lost(ns: Namespace) -> None:
    """As in the SDK, a session receiver's peek and deferred receive check the session lock first."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0", "m1"])
    r = ns.get_queue_receiver("q", session_id="s1")
    (m,) = _take(r, 1)
    r.defer_message(m)
    assert [p.message_id for p in r.peek_messages(5)] == ["m0", "m1"]
    assert r.session is not None
    _sleep_past(r.session.locked_until_utc)
    with pytest.raises(SessionLockLostError):
        r.peek_messages(5)
    with pytest.raises(SessionLockLostError):
        r.receive_deferred_messages([m.sequence_number])
    with pytest.raises(SessionLockLostError):  # an unknown number too: the lock is checked first
        r.receive_deferred_messages([m.sequence_number + 1000])
    with ns.get_queue_receiver("q", session_id="s1") as r2:
        with pytest.raises(SessionLockLostError):  # taken by another receiver
            r.peek_messages(5, sequence_number=0)
        assert [p.message_id for p in r2.peek_messages(5)] == ["m0", "m1"]
    r.close()


def test_a_drained_session_stays_with_its_holder_until_it_closes(ns: Namespace) -> None:
    """SPEC §6: while a receiver holds the session lock no other receiver gets the session's messages, drained or not.

    A completion that emptied a stateless session used to end the hold: a message sent to the session
    next went to another receiver, and the holder, its lock still valid, got SessionLockLostError.
    """
    _session_queue(ns)  # default lock_duration: 60 s
    _send(ns, "s1", ["m0", "m1"])
    first = ns.get_queue_receiver("q", session_id="s1")
    first.complete_messages(_take(first, 2))
    assert _sessions(ns)["s1"].locked_until_utc is not None  # still held
    _send(ns, "s1", ["m2"])
    with pytest.raises(OperationTimeoutError):
        ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.5)
    with pytest.raises(SessionCannotBeLockedError):
        ns.get_queue_receiver("q", session_id="s1")
    got = _take(first, 1)
    assert [m.message_id for m in got] == ["m2"]
    first.complete_messages(got)
    first.close()  # releases at once, and forgets the finished session
    assert "s1" not in _sessions(ns)
    _send(ns, "s1", ["m3"])
    with ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as second:
        assert [m.message_id for m in _take(second, 1)] == ["m3"]
    assert ns.get_queue_runtime_properties("q").active_message_count == 1  # m3 was received, not completed


def test_holder_of_a_drained_session_receives_what_comes_next(ns: Namespace) -> None:
    """After emptying its session the holder goes on receiving it, in order; another receiver is refused throughout."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    with ns.get_queue_receiver("q", session_id="s1") as holder:
        holder.complete_messages(_take(holder, 1))
        assert holder.receive_messages(max_wait_time=0.2) == []
        assert holder.session is not None and holder.session.get_state() is None
        _send(ns, "s1", ["m1", "m2"])
        got = _take(holder, 2)
        assert [m.message_id for m in got] == ["m1", "m2"]
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        holder.complete_messages(got)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_a_session_with_state_stays_held_after_its_last_completion(ns: Namespace) -> None:
    """Only a stateless session ends with its last completion: one with state stays held until close."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    with ns.get_queue_receiver("q", session_id="s1") as holder:
        assert holder.session is not None
        holder.session.set_state(b"progress")
        holder.complete_messages(_take(holder, 1))
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        assert holder.session.get_state() == b"progress"
    assert _sessions(ns)["s1"].locked_until_utc is None


# ---- session lock expiry and renewal ------------------------------------------------------------


def test_operations_after_session_lock_expiry_raise_session_lock_lost(ns: Namespace) -> None:
    """Once the session lock expires, receive, settle, state and renew calls raise SessionLockLostError."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0", "m1"])
    r = ns.get_queue_receiver("q", session_id="s1")
    assert r.session is not None
    (m0,) = _take(r, 1)
    _sleep_past(r.session.locked_until_utc)
    with pytest.raises(SessionLockLostError):
        r.receive_messages(max_message_count=1)
    with pytest.raises(SessionLockLostError):
        r.complete_message(m0)
    with pytest.raises(SessionLockLostError):
        r.session.get_state()
    with pytest.raises(SessionLockLostError):
        r.session.set_state(b"x")
    with pytest.raises(SessionLockLostError):
        r.session.renew_lock()
    r.close()  # closing after the loss is harmless
    assert _sessions(ns)["s1"].active_message_count == 2  # the failed complete changed nothing
    assert _sessions(ns)["s1"].state is None  # nor did the failed set_state


def test_expired_session_can_be_taken_over_and_old_holder_cannot_act(ns: Namespace) -> None:
    """After session expiry a new holder gets the unsettled head first; the former holder's settle raises, changing nothing."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0", "m1"])
    old = ns.get_queue_receiver("q", session_id="s1")
    assert old.session is not None
    (m0,) = _take(old, 1)
    _sleep_past(old.session.locked_until_utc)
    with ns.get_queue_receiver("q", session_id="s1") as new:
        (again,) = _take(new, 1)
        assert again.message_id == "m0"
        with pytest.raises(SessionLockLostError):
            old.complete_message(m0)
        with pytest.raises(SessionLockLostError):
            old.session.set_state(b"stale")
        new.complete_message(again)
        assert new.session is not None and new.session.get_state() is None
        assert [m.message_id for m in _take(new, 1)] == ["m1"]
    old.close()
    assert ns.get_queue_runtime_properties("q").total_message_count == 1


def test_delivery_count_rises_when_a_session_lock_expires(ns: Namespace) -> None:
    """A message redelivered after its session lock expired has a higher delivery_count."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0"])
    counts = []
    for _ in range(3):
        r = ns.get_queue_receiver("q", session_id="s1")
        assert r.session is not None
        (m,) = _take(r, 1)
        assert m.message_id == "m0"
        counts.append(m.delivery_count)
        _sleep_past(r.session.locked_until_utc)
    assert counts == [0, 1, 2]


def test_renew_lock_extends_the_session_lock(ns: Namespace) -> None:
    """renew_lock moves locked_until_utc forward and keeps the session held past its first expiry."""
    _session_queue(ns, lock=timedelta(seconds=6))
    _send(ns, "s1", ["m0", "m1"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        first_until = r.session.locked_until_utc
        (m0,) = _take(r, 1)
        last = first_until
        while datetime.now(UTC) < first_until + timedelta(seconds=1):
            time.sleep(0.3)
            new_until = r.session.renew_lock()
            assert new_until > last
            assert r.session.locked_until_utc == new_until
            assert m0.locked_until_utc == new_until  # a session message's lock is the session's
            with pytest.raises(TypeError):
                r.renew_message_lock(m0)
            last = new_until
        r.session.renew_lock()
        # past the original expiry: still held by r, and r can still work
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        assert _sessions(ns)["s1"].locked_until_utc is not None
        r.complete_message(m0)
        assert [m.message_id for m in _take(r, 1)] == ["m1"]


# ---- per-session FIFO ----------------------------------------------------------------------------


def test_holder_receives_further_messages_before_settling_earlier_ones(ns: Namespace) -> None:
    """The session holder may receive the next messages while earlier ones are unsettled, in sequence order."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1", "m2"])
    with ns.get_queue_receiver("q", session_id="s1", max_wait_time=2) as r:
        got = [m.message_id for m in r]  # `for msg in receiver` without settling yields the whole session
        assert got == ["m0", "m1", "m2"]


def test_batch_receive_returns_a_session_prefix_in_order(ns: Namespace) -> None:
    """A multi-message receive returns the session's leading messages in sequence order."""
    _session_queue(ns)
    _send(ns, "s1", [f"m{i}" for i in range(6)])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        got = r.receive_messages(max_message_count=4, max_wait_time=2)
        assert [m.message_id for m in got] == ["m0", "m1", "m2", "m3"]
        for m in got:
            r.complete_message(m)
        assert [m.message_id for m in _take(r, 2)] == ["m4", "m5"]


def test_abandoned_message_is_redelivered_before_later_ones(ns: Namespace) -> None:
    """Strict FIFO across abandon: an abandoned message comes back before the session's later messages."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        order = []
        for _ in range(3):
            (m,) = _take(r, 1)
            order.append((m.message_id, m.delivery_count))
            r.abandon_message(m)
        (m,) = _take(r, 1)
        r.complete_message(m)
        order.append((m.message_id, m.delivery_count))
        (m,) = _take(r, 1)
        order.append((m.message_id, m.delivery_count))
    assert order == [("m0", 0), ("m0", 1), ("m0", 2), ("m0", 3), ("m1", 0)]


def test_message_whose_lock_expired_is_redelivered_before_later_ones(ns: Namespace) -> None:
    """A session's messages share its lock: when it expires, the next holder gets them again first, in order."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0", "m1", "m2"])
    r = ns.get_queue_receiver("q", session_id="s1")
    m0, m1 = _take(r, 2)
    r.complete_message(m0)
    assert m1.locked_until_utc == r.session.locked_until_utc
    while datetime.now(UTC) < r.session.locked_until_utc + timedelta(milliseconds=100):
        time.sleep(0.1)
    with pytest.raises(SessionLockLostError):
        r.complete_message(m1)
    with ns.get_queue_receiver("q", session_id="s1") as r2:
        got = _take(r2, 2)
        assert [m.message_id for m in got] == ["m1", "m2"]
        assert got[0].delivery_count == 1  # handed out once before


def test_several_abandoned_messages_each_come_back_before_later_ones(ns: Namespace) -> None:
    """Strict FIFO across several abandons: each abandoned message comes back before any later (cached) one."""
    _session_queue(ns)
    _send(ns, "s1", [f"m{i}" for i in range(5)])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        m0, m1 = _take(r, 2)
        r.abandon_message(m0)
        r.abandon_message(m1)
        assert [m.message_id for m in _consume_all(r)] == ["m0", "m1", "m2", "m3", "m4"]
    _send(ns, "s2", [f"n{i}" for i in range(5)])
    with ns.get_queue_receiver("q", session_id="s2") as r:
        n0, _n1, n2 = _take(r, 3)
        r.abandon_message(n2)
        r.abandon_message(n0)  # n1 is still held
        got = [m.message_id for m in r.receive_messages(1) + r.receive_messages(1) + r.receive_messages(2)]
        assert got == ["n0", "n2", "n3", "n4"]


def test_new_holder_gets_an_abandoned_message_first_behind_a_thousand_scheduled_ones(ns: Namespace) -> None:
    """The accept's head is the session's earliest available message even behind a full file of other rows.

    An accept keeps a session's first KEEP_TOGETHER rows together; an abandoned message behind them
    (here: 1,000 scheduled messages first) still comes before the earlier holder's later messages. A 5 s lock:
    the first holder's accept, receive and abandon take up to a second on a loaded machine.
    """
    _session_queue(ns, lock=timedelta(seconds=5))
    with ns.get_queue_sender("q") as s:
        later = datetime.now(UTC) + timedelta(days=1)
        s.schedule_messages([Message(f"s{i}", session_id="S") for i in range(1000)], later)
    _send(ns, "S", [f"m{i}" for i in range(6)])
    a = ns.get_queue_receiver("q", session_id="S")
    got = _take(a, 4)
    assert [m.message_id for m in got] == ["m0", "m1", "m2", "m3"]
    a.abandon_message(got[0])
    _sleep_past(a.session.locked_until_utc)  # a's locks on m1..m5 lapse with its session lock
    with ns.get_queue_receiver("q", session_id="S") as b:
        assert [m.message_id for m in _consume_all(b)] == [f"m{i}" for i in range(6)]


def test_dead_lettered_and_deferred_messages_step_out_of_the_sequence(ns: Namespace) -> None:
    """Deferring or dead-lettering a session's head lets its next message through; the deferred one is fetched by number."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1", "m2"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        (m0,) = _take(r, 1)
        r.defer_message(m0)
        (m1,) = _take(r, 1)
        assert m1.message_id == "m1"
        r.dead_letter_message(m1, reason="bad")
        (m2,) = _take(r, 1)
        assert m2.message_id == "m2"
        r.complete_message(m2)
        (d,) = r.receive_deferred_messages([m0.sequence_number])
        assert d.message_id == "m0"
        info = _sessions(ns)["s1"]
        assert (info.active_message_count, info.deferred_message_count) == (0, 1)
        r.complete_message(d)
    assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 1


def test_session_operations_leave_the_locks_of_its_dead_letters_alone(ns: Namespace) -> None:
    """Dead letters of a session are locked by dead-letter receivers: accepting, renewing or closing it keeps their locks."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1", "m2"])
    with ns.get_queue_receiver("q", session_id="s1") as a:
        (m0,) = _take(a, 1)
        a.dead_letter_message(m0, reason="bad")
    dlq = ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER, max_wait_time=0.3)
    (dead,) = _take(dlq, 1)
    other = ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER, max_wait_time=0.3)
    with ns.get_queue_receiver("q", session_id="s1") as b:  # an accept: it clears an earlier holder's locks, not these
        (m1,) = _take(b, 1)
        assert other.receive_messages(5) == []
        b.session.renew_lock()
        assert other.receive_messages(5) == []
        b.complete_message(m1)
    assert other.receive_messages(5) == []  # the close released the session
    dlq.complete_message(dead)  # still the dead-letter receiver's lock
    assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 0
    with ns.get_queue_receiver("q", session_id="s1") as c:
        assert [m.message_id for m in _consume_all(c)] == ["m2"]


def test_a_session_receiver_does_not_settle_its_sessions_dead_letters(ns: Namespace) -> None:
    """A session's dead letter belongs to the dead-letter sub-queue: completing it through the session receiver
    raises MessageLockLostError and leaves it there, locked by its dead-letter receiver."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1"])
    with ns.get_queue_receiver("q", session_id="s1") as r, ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as dlq:
        r.dead_letter_message(_take(r, 1)[0])
        (dead,) = _take(dlq, 1)
        with pytest.raises(MessageLockLostError):
            r.complete_message(dead)
        assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 1
        dlq.complete_message(dead)
    assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 0


def test_completing_a_message_twice_in_one_call_does_not_end_a_session_with_messages_left(ns: Namespace) -> None:
    """The last-completion rule counts messages, not items: a message given twice leaves the session held."""
    _session_queue(ns)
    _send(ns, "s1", ["m0", "m1"])
    with ns.get_queue_receiver("q", session_id="s1") as a:
        (m0,) = _take(a, 1)
        a.complete_messages([m0, m0])
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        assert [m.message_id for m in _consume_all(a)] == ["m1"]


def test_receive_and_delete_session_receiver_takes_messages_in_order(ns: Namespace) -> None:
    """In RECEIVE_AND_DELETE mode a session receiver removes the session's messages in sequence order."""
    _session_queue(ns)
    _send(ns, "s1", [f"m{i}" for i in range(5)])
    _send(ns, "s2", ["other"])
    with ns.get_queue_receiver("q", session_id="s1", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        got = [m.message_id for m in _take(r, 5)]
    assert got == [f"m{i}" for i in range(5)]
    assert ns.get_queue_runtime_properties("q").total_message_count == 1


# ---- session state ---------------------------------------------------------------------------------


def test_session_state_survives_receiver_restarts_and_none_clears_it(ns: Namespace) -> None:
    """Session state set by one receiver is read by later ones (any process) until set_state(None) clears it."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        assert r.session.get_state() is None
        r.session.set_state(b"\x00step-1\xff")
        assert r.session.get_state() == b"\x00step-1\xff"
    with Namespace(ns.root) as other, other.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        assert r.session.get_state() == b"\x00step-1\xff"
        r.session.set_state("step-2 ✓")  # str is stored as UTF-8
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        assert r.session.get_state() == "step-2 ✓".encode()
        r.session.set_state(None)
        assert r.session.get_state() is None
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        assert r.session.get_state() is None
    assert _sessions(ns)["s1"].state is None


def test_session_state_outlives_the_sessions_messages(ns: Namespace) -> None:
    """State is kept after the session's last message is completed, and listed with the session."""
    _session_queue(ns)
    _send(ns, "s1", ["m0"])
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        (m,) = _take(r, 1)
        r.complete_message(m)
        r.session.set_state(b"done")
    info = _sessions(ns)["s1"]
    assert info.state == b"done"
    assert info.active_message_count == 0
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        assert r.session.get_state() == b"done"


def test_session_state_rejects_other_types(ns: Namespace) -> None:
    """set_state accepts bytes, str or None only (InvalidOperationError otherwise) and keeps the old state."""
    _session_queue(ns)
    with ns.get_queue_receiver("q", session_id="s1") as r:
        assert r.session is not None
        r.session.set_state(b"keep")
        with pytest.raises(InvalidOperationError):
            r.session.set_state(42)  # type: ignore[arg-type]
        assert r.session.get_state() == b"keep"


def test_session_states_are_independent(ns: Namespace) -> None:
    """Each session has its own state, also for sessions in the same partition."""
    _session_queue(ns, enable_partitioning=False)  # one partition: every session shares it
    for sid in ("a", "b", "c"):
        with ns.get_queue_receiver("q", session_id=sid) as r:
            assert r.session is not None
            r.session.set_state(f"state-{sid}")
    with ns.get_queue_receiver("q", session_id="b") as r:
        assert r.session is not None
        r.session.set_state(None)
    states = {k: v.state for k, v in _sessions(ns).items()}
    assert (states["a"], states.get("b"), states["c"]) == (b"state-a", None, b"state-c")


# ---- listing sessions --------------------------------------------------------------------------------


def test_list_sessions_reports_state_lock_and_counts(ns: Namespace) -> None:
    """list_queue_sessions lists each session with its state, lock expiry (None when free) and message counts."""
    _session_queue(ns)
    _send(ns, "busy", ["b0", "b1", "b2"])
    _send(ns, "idle", ["i0", "i1"])
    with ns.get_queue_receiver("q", session_id="stateful") as r:
        assert r.session is not None
        r.session.set_state(b"s")
    holder = ns.get_queue_receiver("q", session_id="busy")
    try:
        assert holder.session is not None
        (b0,) = _take(holder, 1)
        holder.defer_message(b0)
        listed = ns.list_queue_sessions("q")
        assert [s.session_id for s in listed] == sorted(s.session_id for s in listed)
        info = {s.session_id: s for s in listed}
        assert set(info) == {"busy", "idle", "stateful"}
        assert (info["busy"].active_message_count, info["busy"].deferred_message_count) == (2, 1)
        assert info["busy"].locked_until_utc == holder.session.locked_until_utc
        assert info["busy"].state is None
        assert (info["idle"].active_message_count, info["idle"].deferred_message_count) == (2, 0)
        assert info["idle"].locked_until_utc is None
        assert info["stateful"].state == b"s"
        assert (info["stateful"].active_message_count, info["stateful"].locked_until_utc) == (0, None)
    finally:
        holder.close()
    assert _sessions(ns)["busy"].locked_until_utc is None


def test_finished_session_without_state_is_no_longer_listed(ns: Namespace) -> None:
    """A released session with no messages and no state is forgotten; one with state or messages stays listed."""
    _session_queue(ns)
    _send(ns, "done", ["d0"])
    _send(ns, "kept", ["k0"])
    _send(ns, "pending", ["p0", "p1"])
    _send(ns, "emptied", ["e0"])
    for sid in ("done", "kept", "emptied"):
        with ns.get_queue_receiver("q", session_id=sid) as r:
            assert r.session is not None
            _consume_all(r)
            r.session.set_state(b"x")
            if sid == "done":
                r.session.set_state(None)
            if sid == "emptied":  # Service Bus reads an empty state as none
                r.session.set_state(b"")
                assert r.session.get_state() is None
    with ns.get_queue_receiver("q", session_id="pending") as r:
        (p0,) = _take(r, 1)
        r.complete_message(p0)
    info = _sessions(ns)
    assert set(info) == {"kept", "pending"}
    assert (info["kept"].state, info["pending"].active_message_count) == (b"x", 1)
    with ns.get_queue_receiver("q", session_id="done") as r:  # accepting it again starts afresh
        assert r.session is not None and r.session.get_state() is None
        assert "done" in _sessions(ns)  # listed while locked


def test_an_empty_session_whose_holder_never_released_it_is_not_listed_after_its_lock(ns: Namespace) -> None:
    """A session with no messages and no state whose holder vanished (its lock lapsed) is not listed as a session."""
    _session_queue(ns, lock=SHORT)
    r = ns.get_queue_receiver("q", session_id="ghost")  # a named session with nothing in it yet
    assert r.session is not None
    assert "ghost" in _sessions(ns)  # listed while held
    _sleep_past(r.session.locked_until_utc)  # the holder is gone without closing (as if killed)
    assert "ghost" not in _sessions(ns)


def test_list_sessions_shows_an_expired_lock_as_free(ns: Namespace) -> None:
    """A session whose lock expired is listed with locked_until_utc None."""
    _session_queue(ns, lock=SHORT)
    _send(ns, "s1", ["m0"])
    r = ns.get_queue_receiver("q", session_id="s1")
    assert r.session is not None
    assert _sessions(ns)["s1"].locked_until_utc is not None
    _sleep_past(r.session.locked_until_utc)
    assert _sessions(ns)["s1"].locked_until_utc is None
    r.close()


# ---- subscriptions -------------------------------------------------------------------------------------


def test_session_receivers_on_a_subscription(ns: Namespace) -> None:
    """A session-enabled subscription gives named and next-available session receivers, exclusive and FIFO."""
    ns.create_topic("t")
    ns.create_subscription("t", "ss", requires_session=True)
    ns.create_subscription("t", "plain")
    with ns.get_topic_sender("t") as s:
        for i in range(3):
            s.send_messages([Message(f"{k}{i}", session_id=k, message_id=f"{k}{i}") for k in ("a", "b")])
    with pytest.raises(InvalidOperationError):
        ns.get_subscription_receiver("t", "ss")
    with ns.get_subscription_receiver("t", "ss", session_id="a") as ra:
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_subscription_receiver("t", "ss", session_id="a")
        got = _consume_all(ra)
        assert [m.message_id for m in got] == ["a0", "a1", "a2"]
        assert ra.session is not None
        ra.session.set_state(b"sub-state")
    with ns.get_subscription_receiver("t", "ss", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as rb:
        assert rb.session is not None and rb.session.session_id == "b"
        assert [m.message_id for m in _consume_all(rb)] == ["b0", "b1", "b2"]
    subs = {s.session_id: s for s in ns.list_subscription_sessions("t", "ss")}
    assert set(subs) == {"a"}  # "b" ended with no state and no messages
    assert (subs["a"].state, subs["a"].active_message_count) == (b"sub-state", 0)
    # the plain subscription got its own copies, untouched by the session receivers
    with ns.get_subscription_receiver("t", "plain") as rp:
        got = []
        while True:
            batch = rp.receive_messages(max_message_count=10, max_wait_time=0.3)
            if not batch:
                break
            got.extend(batch)
    assert sorted(m.message_id for m in got) == sorted([f"a{i}" for i in range(3)] + [f"b{i}" for i in range(3)])


def test_subscription_session_lock_expires(ns: Namespace) -> None:
    """A subscription's session lock expires like a queue's: SessionLockLostError, then another receiver takes over."""
    ns.create_topic("t")
    ns.create_subscription("t", "ss", requires_session=True, lock_duration=SHORT)
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x", session_id="a", message_id="x"))
    r = ns.get_subscription_receiver("t", "ss", session_id="a")
    assert r.session is not None
    (m,) = _take(r, 1)
    _sleep_past(r.session.locked_until_utc)
    with pytest.raises(SessionLockLostError):
        r.complete_message(m)
    with ns.get_subscription_receiver("t", "ss", session_id="a") as r2:
        (again,) = _take(r2, 1)
        assert (again.message_id, again.delivery_count) == ("x", 1)
        r2.complete_message(again)
    r.close()
    assert ns.get_subscription_runtime_properties("t", "ss").total_message_count == 0


# ---- exclusivity corner cases ----------------------------------------------------------------------------


def test_deferred_message_of_a_session_is_received_only_by_its_session(ns: Namespace) -> None:
    """receive_deferred_messages on a session receiver reaches only its own session's deferred messages: another
    session's raise MessageNotFoundError (as the SDK)."""
    _session_queue(ns, enable_partitioning=False)  # both sessions in one partition
    _send(ns, "a", ["a0"])
    with ns.get_queue_receiver("q", session_id="a") as ra:
        (a0,) = _take(ra, 1)
        ra.defer_message(a0)
        with ns.get_queue_receiver("q", session_id="b") as rb, pytest.raises(MessageNotFoundError):
            rb.receive_deferred_messages([a0.sequence_number])
        (d,) = ra.receive_deferred_messages([a0.sequence_number])
        assert (d.message_id, d.session_id) == ("a0", "a")
        ra.complete_message(d)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_next_available_session_is_found_behind_a_large_held_session(ns: Namespace) -> None:
    """NEXT_AVAILABLE_SESSION finds a free session even when a held session has a long backlog ahead of it."""
    _session_queue(ns, enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"a{i}", session_id="big") for i in range(1500)])
        s.send_messages(Message("small-0", session_id="small", message_id="small-0"))
    big = ns.get_queue_receiver("q", session_id="big")
    try:
        with ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as r:
            assert r.session is not None and r.session.session_id == "small"
            assert [m.message_id for m in _take(r, 1)] == ["small-0"]
    finally:
        big.close()


def test_accepting_a_session_delivers_nothing_without_a_prefetch(ns: Namespace) -> None:
    """As the SDK: only a receive (or a prefetch_count) delivers and counts a delivery.

    Before, every accept locked up to 100 messages and counted a delivery on each: a receiver that
    only peeked dead-lettered them at max_delivery_count=1, and lapsed holds dead-lettered messages
    nobody had been handed.
    """
    ns.create_queue("q", requires_session=True, max_delivery_count=1, lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", session_id="s") for i in range(3)])
    for _ in range(2):  # a peek-only holder whose hold lapses (a slow one), twice
        with ns.get_queue_receiver("q", session_id="s") as r:
            assert [str(m) for m in r.peek_messages(10)] == ["m0", "m1", "m2"]
            time.sleep(1.3)
    with ns.get_queue_receiver("q", session_id="s") as r:
        got = r.receive_messages(10)
        assert [(str(m), m.delivery_count) for m in got] == [("m0", 0), ("m1", 0), ("m2", 0)]
        r.complete_messages(got)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as r:
        assert r.peek_messages(10) == []


def test_a_session_prefetch_delivers_with_the_accept_and_counts_as_the_sdk_does(ns: Namespace) -> None:
    ns.create_queue("q", requires_session=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", session_id="s") for i in range(5)])
    with ns.get_queue_receiver("q", session_id="s", prefetch_count=3) as r:
        (first,) = r.receive_messages(1)
        assert (str(first), first.delivery_count) == ("m0", 0)
        assert [str(m) for m in r.receive_messages(10)] == ["m1", "m2"]  # the prefetched ones, then the store
        assert [str(m) for m in r.receive_messages(10)] == ["m3", "m4"]


def test_listing_sessions_refuses_an_entity_without_them_and_leaves_scheduled_messages_out(ns: Namespace) -> None:
    ns.create_queue("plain")
    with pytest.raises(InvalidOperationError, match="does not require sessions"):
        ns.list_queue_sessions("plain")
    ns.create_queue("q", requires_session=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("now", session_id="s"), Message("now too", session_id="s")])
        s.schedule_messages(Message("later", session_id="s"), datetime.now(UTC) + timedelta(hours=1))
    (info,) = ns.list_queue_sessions("q")
    assert (info.session_id, info.active_message_count) == ("s", 2)  # as runtime properties: 2 active, 1 scheduled


def test_a_session_receiver_given_a_closed_renewer_gives_the_session_back(ns: Namespace) -> None:
    from sparkqueue import AutoLockRenewer

    ns.create_queue("q", requires_session=True)
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("m", session_id="s"))
    renewer = AutoLockRenewer()
    renewer.close()
    with pytest.raises(InvalidOperationError, match="closed"):
        ns.get_queue_receiver("q", session_id="s", auto_lock_renewer=renewer)
    with ns.get_queue_receiver("q", session_id="s") as r:  # not left locked until expiry
        assert [str(m) for m in r.receive_messages(1)] == ["m"]


def test_a_receive_and_delete_session_receiver_hands_out_its_prefetched_messages_after_the_lock_lapses(
    ns: Namespace,
) -> None:
    """RECEIVE_AND_DELETE with a prefetch: the prefetched messages are gone from the queue already. Before, a lapsed
    session lock made the receiver drop them (as peek-lock does, for the next holder): nobody ever got them."""
    ns.create_queue("q", requires_session=True, lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", session_id="s1") for i in range(6)])
    r = ns.get_queue_receiver("q", session_id="s1", receive_mode=ReceiveMode.RECEIVE_AND_DELETE, prefetch_count=5)
    got = [str(m) for m in r.receive_messages(1, max_wait_time=5)]
    time.sleep(1.5)  # the session lock lapses
    got += [str(m) for m in r.receive_messages(5, max_wait_time=0.5)]
    with pytest.raises(SessionLockLostError):  # nothing cached any more: the store read needs the lock
        r.receive_messages(1, max_wait_time=0.5)
    r.close()
    assert got == [f"m{i}" for i in range(6)]
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
