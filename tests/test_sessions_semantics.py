"""Service Bus session semantics across real processes (docs/semantics.md §6, issue #15).

Each rule is exercised with the session holder in a child process ("spawn") and the checks made
by the parent or another child: receiving ahead of settlement in order, abandon returning first,
the session lock covering its messages, session-scoped peek, NEXT_AVAILABLE_SESSION timing out
with OperationTimeoutError, sessionless topic copies dead-lettered at fan-out, and a holder
SIGKILLed mid-batch whose session comes back at lock expiry, in order, with nothing lost.
Children report through durably appended JSON lines, so a kill cannot lose what was reported.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace
from sparkqueue.errors import OperationTimeoutError, SessionCannotBeLockedError, SessionLockLostError

CTX = mp.get_context("spawn")
JOIN_S = 120


def _record(path: str, obj: Any) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path: str | Path) -> list[Any]:
    p = Path(path)
    out = []
    for line in p.read_text(encoding="utf-8").split("\n") if p.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _wait_for(pred: Any, timeout_s: float = 60.0, what: str = "condition") -> None:
    give_up = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _start(target: Any, *args: Any) -> Any:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _finish(p: Any) -> None:
    p.join(JOIN_S)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0


def _send(root: str, queue: str, session: str, ids: list[str]) -> None:
    with Namespace(root) as ns, ns.get_queue_sender(queue) as s:
        s.send_messages([Message(i, session_id=session, message_id=i) for i in ids])


# ---- children ----------------------------------------------------------------------------------------


def child_script(root: str, queue: str, session: str, script: list[str], out: str, go: str) -> None:
    """Hold a named session and run a small script, reporting what each step saw; hold until `go` exists.

    Steps: "recv:N" (receive up to N, report ids and delivery counts), "abandon:i" / "complete:i"
    (settle the i-th received message), "peek:N", "renew_msg:i" (report the error type),
    "until" (report message and session lock expiries).
    """
    got: list[Any] = []
    with Namespace(root) as ns, ns.get_queue_receiver(queue, session_id=session, max_wait_time=2) as r:
        assert r.session is not None
        for step in script:
            name, _, arg = step.partition(":")
            if name == "recv":
                batch = r.receive_messages(max_message_count=int(arg), max_wait_time=2)
                got.extend(batch)
                _record(out, {"step": step, "ids": [m.message_id for m in batch], "dc": [m.delivery_count for m in batch]})
            elif name in ("abandon", "complete"):
                getattr(r, f"{name}_message")(got[int(arg)])
                _record(out, {"step": step})
            elif name == "peek":
                _record(out, {"step": step, "sessions": sorted({m.session_id for m in r.peek_messages(int(arg))})})
            elif name == "renew_msg":
                try:
                    r.renew_message_lock(got[int(arg)])
                    _record(out, {"step": step, "error": None})
                except Exception as exc:  # the type is what the test checks
                    _record(out, {"step": step, "error": type(exc).__name__})
            elif name == "until":
                same = all(m.locked_until_utc == r.session.locked_until_utc for m in got)
                _record(out, {"step": step, "same": same, "count": len(got)})
        _record(out, {"step": "holding"})
        while not os.path.exists(go):
            time.sleep(0.02)


def child_receive_then_hang(root: str, queue: str, session: str, complete: int, out: str) -> None:
    """Accept a session, receive a batch, complete the first `complete` messages (reporting each), then hang."""
    with Namespace(root) as ns:
        r = ns.get_queue_receiver(queue, session_id=session, max_wait_time=2)
        batch = r.receive_messages(max_message_count=50, max_wait_time=2)
        _record(out, {"received": [m.message_id for m in batch]})
        for m in batch[:complete]:
            r.complete_message(m)
            _record(out, {"completed": m.message_id})
        while True:
            time.sleep(1)


def child_try_next(root: str, queue: str, out: str) -> None:
    """Try NEXT_AVAILABLE_SESSION (0.5 s) and a named accept of "s1"; report the error types."""
    with Namespace(root) as ns:
        res = {}
        for key, sid in (("next", NEXT_AVAILABLE_SESSION), ("named", "s1")):
            try:
                r = ns.get_queue_receiver(queue, session_id=sid, max_wait_time=0.5)
                res[key] = f"accepted {r.session.session_id if r.session else None}"
                r.close()
            except Exception as exc:
                res[key] = type(exc).__name__
        _record(out, res)


def child_topic_send(root: str, topic: str) -> None:
    with Namespace(root) as ns, ns.get_topic_sender(topic) as s:
        s.send_messages([Message("no-session", message_id="none"), Message("with", message_id="with", session_id="s1")])


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.fixture
def queue(root: str) -> str:
    with Namespace(root) as ns:
        ns.create_queue("q", requires_session=True, lock_duration=timedelta(seconds=30))
    return "q"


def test_holder_receives_ahead_in_order_while_others_get_nothing(root: str, queue: str, tmp_path: Path) -> None:
    """A holder in one process receives the session's messages before settling any, in order; another process meanwhile
    cannot take the session (named: SessionCannotBeLockedError) nor any session (next: OperationTimeoutError)."""
    _send(root, queue, "s1", [f"m{i}" for i in range(5)])
    out, go, tried = str(tmp_path / "out"), str(tmp_path / "go"), str(tmp_path / "tried")
    holder = _start(child_script, root, queue, "s1", ["recv:2", "recv:2", "recv:5"], out, go)
    _wait_for(lambda: any(x["step"] == "holding" for x in _lines(out)), what="the holder")
    other = _start(child_try_next, root, queue, tried)
    _finish(other)
    Path(go).touch()
    _finish(holder)
    seen = [i for x in _lines(out) if x["step"].startswith("recv") for i in x["ids"]]
    assert seen == ["m0", "m1", "m2", "m3", "m4"]
    assert _lines(tried) == [{"next": "OperationTimeoutError", "named": "SessionCannotBeLockedError"}]


def test_abandoned_message_returns_to_the_holder_before_later_ones(root: str, queue: str, tmp_path: Path) -> None:
    """The holder received m0..m2 unsettled, abandons m1: its next receive gives m1 (delivery count 1), then m3."""
    _send(root, queue, "s1", [f"m{i}" for i in range(4)])
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    Path(go).touch()
    holder = _start(child_script, root, queue, "s1", ["recv:3", "abandon:1", "recv:1", "recv:1"], out, go)
    _finish(holder)
    recv = [x for x in _lines(out) if x["step"].startswith("recv")]
    assert [x["ids"] for x in recv] == [["m0", "m1", "m2"], ["m1"], ["m3"]]
    assert recv[1]["dc"] == [1]


def test_session_messages_have_the_session_lock(root: str, queue: str, tmp_path: Path) -> None:
    """In the holder's process a message's locked_until_utc is the session's and renew_message_lock raises TypeError;
    once the lock is lost to another process, settling raises SessionLockLostError."""
    with Namespace(root) as ns:
        ns.create_queue("short", requires_session=True, lock_duration=timedelta(seconds=2))
    _send(root, "short", "s1", ["m0", "m1"])
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    Path(go).touch()
    holder = _start(child_script, root, "short", "s1", ["recv:2", "until", "renew_msg:0"], out, go)
    _finish(holder)
    steps = {x["step"]: x for x in _lines(out)}
    assert steps["until"] == {"step": "until", "same": True, "count": 2}
    assert steps["renew_msg:0"]["error"] == "TypeError"
    # settling after the session lock is lost (taken over by another process after expiry)
    with Namespace(root) as ns:
        r = ns.get_queue_receiver("short", session_id="s1")
        (m0,) = r.receive_messages(max_message_count=1, max_wait_time=2)
        while datetime.now(UTC) <= r.session.locked_until_utc:  # type: ignore[union-attr]
            time.sleep(0.1)
        taker = _start(child_script, root, "short", "s1", ["recv:2"], str(tmp_path / "taker"), go)
        _finish(taker)
        with pytest.raises(SessionLockLostError):
            r.complete_message(m0)


def test_a_receive_right_after_a_renewal_stamps_the_renewed_expiry(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal (an AutoLockRenewer thread) and a receive of the application's thread: a receive that ran between the
    renewal's commit and the holder learning the new expiry stamped its messages with the old one, so settling them
    raised MessageLockLostError once that had passed, though the session lock held. The receive here runs in that gap
    (in the renewing call itself), where a thread switch would put it."""
    from sparkqueue.model import sessions

    with Namespace(root) as ns:
        ns.create_queue("short", requires_session=True, lock_duration=timedelta(seconds=5))
    _send(root, "short", "s1", ["m0"])
    with Namespace(root) as ns, ns.get_queue_receiver("short", session_id="s1") as r:
        assert r.session is not None
        first_until = r.session.locked_until_utc
        got: list[Any] = []
        commit = sessions.retry_commit

        def renew_then_receive(attempt: Any, deadline: Any, what: str) -> Any:
            out = commit(attempt, deadline, what)
            if what == "renew session lock" and not got:
                got.extend(r.receive_messages(max_message_count=1, max_wait_time=1))
            return out

        time.sleep(3.0)  # renewed 3 s into the 5 s lock: the complete below has about 2.5 s of the renewed one
        monkeypatch.setattr(sessions, "retry_commit", renew_then_receive)
        renewed_until = r.session.renew_lock()
        monkeypatch.undo()
        (m0,) = got
        assert m0.locked_until_utc == renewed_until == r.session.locked_until_utc
        while datetime.now(UTC) <= first_until + timedelta(seconds=0.3):  # past the first expiry, before the renewed one
            time.sleep(0.05)
        r.complete_message(m0)


def test_peek_on_a_session_receiver_shows_only_its_session(root: str, queue: str, tmp_path: Path) -> None:
    """Another process's sessions (even in the same partition) never show in a session receiver's peek."""
    for s in ("s1", "s2", "s3"):
        _send(root, queue, s, [f"{s}-{i}" for i in range(3)])
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    Path(go).touch()
    holder = _start(child_script, root, queue, "s2", ["peek:10"], out, go)
    _finish(holder)
    assert [x for x in _lines(out) if x["step"] == "peek:10"] == [{"step": "peek:10", "sessions": ["s2"]}]


def test_sessionless_topic_copy_is_dead_lettered_in_a_session_subscription(root: str) -> None:
    """A message without session id that a session-requiring subscription selects is dead-lettered there, with a reason;
    a plain subscription of the same topic receives it normally."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "sess", requires_session=True)
        ns.create_subscription("t", "plain")
    _finish(_start(child_topic_send, root, "t"))
    with Namespace(root) as ns:
        with ns.get_subscription_receiver("t", "sess", sub_queue="deadletter") as dlq:
            dead = dlq.receive_messages(max_message_count=10, max_wait_time=2)
            assert [(m.message_id, m.dead_letter_reason) for m in dead] == [("none", "SessionIdRequired")]
            for m in dead:
                dlq.complete_message(m)
        with ns.get_subscription_receiver("t", "sess", session_id="s1") as r:
            assert [m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=2)] == ["with"]
        with ns.get_subscription_receiver("t", "plain", max_wait_time=2) as r:
            assert sorted(m.message_id for m in r) == ["none", "with"]


def test_killed_holder_mid_batch_session_returns_at_expiry_in_order(root: str, tmp_path: Path) -> None:
    """A holder SIGKILLed after completing part of a received batch: at lock expiry the session is available again,
    the rest comes back in order (each once more delivered), and nothing is lost or completed twice."""
    with Namespace(root) as ns:
        ns.create_queue("k", requires_session=True, lock_duration=timedelta(seconds=2))
    ids = [f"m{i:02d}" for i in range(20)]
    _send(root, "k", "s1", ids)
    out = str(tmp_path / "out")
    child = _start(child_receive_then_hang, root, "k", "s1", 7, out)
    _wait_for(lambda: len(_lines(out)) >= 8, what="the child to complete part of its batch")
    os.kill(child.pid, signal.SIGKILL)
    child.join(JOIN_S)
    lines = _lines(out)
    assert lines[0]["received"] == ids
    completed = [x["completed"] for x in lines[1:]]
    assert completed == ids[:7]
    with Namespace(root) as ns:
        r = None
        give_up = time.monotonic() + 60
        while r is None:  # held until the killed holder's lock expires
            try:
                r = ns.get_queue_receiver("k", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1)
            except OperationTimeoutError:
                assert time.monotonic() < give_up, "the killed holder's session never became available"
        with r:
            assert r.session is not None and r.session.session_id == "s1"
            rest = r.receive_messages(max_message_count=50, max_wait_time=2)
            assert [m.message_id for m in rest] == ids[7:]
            assert all(m.delivery_count == 1 for m in rest)
            r.complete_messages(rest)
        assert ns.get_queue_runtime_properties("k").total_message_count == 0
        with pytest.raises(OperationTimeoutError):
            ns.get_queue_receiver("k", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.3)
        with pytest.raises(SessionCannotBeLockedError), ns.get_queue_receiver("k", session_id="s1"):
            ns.get_queue_receiver("k", session_id="s1")
