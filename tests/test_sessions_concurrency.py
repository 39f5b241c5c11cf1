"""Sessions and transactions across real processes (docs/semantics.md §6, §7, §10): the session lock is exclusive
between processes, per-session FIFO and exactly-once completion hold while receivers race over
many sessions, and a process killed inside or while committing a transaction leaves no partial batch.

Children run with the "spawn" start method, open their own Namespace(root) and report through
files (durably written, so a SIGKILL cannot lose what was reported before it).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import renewing

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace
from sparkqueue.errors import (
    OperationTimeoutError,
    SessionCannotBeLockedError,
    SessionLockLostError,
)

CTX = mp.get_context("spawn")
JOIN_S = 120


# ---- helpers ---------------------------------------------------------------------------------


def _record(path: str, obj: Any) -> None:
    """Append one JSON line durably."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path: str | Path) -> list[Any]:
    """The JSON lines of a report file; a last line still being written (or cut by a kill) is left out."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # empty, or a partial line
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


def _join_all(procs: list[Any]) -> None:
    for p in procs:
        p.join(JOIN_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "child processes did not finish"
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _peek_all(ns: Namespace, queue: str) -> list[Any]:
    """Every stored message of a (sessionless) queue, browsing until a peek returns none."""
    with ns.get_queue_receiver(queue) as r:
        out = r.peek_messages(250, sequence_number=0)
        while True:
            got = r.peek_messages(250)
            if not got:
                return out
            out.extend(got)


# ---- child processes --------------------------------------------------------------------------------


def child_hold_session(root: str, queue: str, session: str, ready_path: str, release_path: str) -> None:
    """Accept a named session, receive its first message, report, and hold until told to close (or killed)."""
    with Namespace(root) as ns, ns.get_queue_receiver(queue, session_id=session) as r:
        got = []
        while not got:
            got = r.receive_messages(max_message_count=1, max_wait_time=1)
        _record(ready_path, {"message_id": got[0].message_id, "delivery_count": got[0].delivery_count})
        while not os.path.exists(release_path):
            time.sleep(0.02)
    _record(ready_path, {"closed": True})


def child_try_accept(root: str, rounds: list[tuple[str, str | None]], barrier: Any, out_path: str, release: Any) -> None:
    """Per round (queue, session or None for next-available): race the other children to accept; report who won what.

    Winners hold their session until every child has reported (`release`)."""
    held = []
    with Namespace(root) as ns:
        for queue, session in rounds:
            barrier.wait(timeout=60)
            sid = NEXT_AVAILABLE_SESSION if session is None else session
            try:
                r = ns.get_queue_receiver(queue, session_id=sid, max_wait_time=0.5)
            except (SessionCannotBeLockedError, OperationTimeoutError):
                _record(out_path, {"queue": queue, "won": None})
                continue
            assert r.session is not None
            held.append(r)
            _record(out_path, {"queue": queue, "won": r.session.session_id})
        release.wait(timeout=60)
        for r in held:
            r.close()


def child_drained_holder(root: str, queue: str, rounds: int, barrier: Any, out_path: str) -> None:
    """Per round: drain session e<r> by completing its last message, send it a new one, then renew as the race starts."""
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        for r in range(rounds):
            with ns.get_queue_receiver(queue, session_id=f"e{r}") as receiver:
                (first,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
                receiver.complete_message(first)  # the last one: drained, still held
                sender.send_messages(Message("later", session_id=f"e{r}"))
                assert receiver.session is not None
                barrier.wait(timeout=60)
                try:
                    receiver.session.renew_lock()  # racing an accept of the session
                    _record(out_path, {"round": r, "holder": "renewed"})
                except SessionLockLostError:
                    _record(out_path, {"round": r, "holder": "lost"})
                barrier.wait(timeout=60)


def child_drained_receiver(root: str, queue: str, rounds: int, barrier: Any, out_path: str) -> None:
    """Per round: drain session e<r>, schedule 1,000 messages ahead of a new one, then receive as the race starts.

    The new message lies past the rows an accept rewrites, in another file: the holder still gets it.
    """
    with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
        for r in range(rounds):
            with ns.get_queue_receiver(queue, session_id=f"e{r}") as receiver:
                (first,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
                receiver.complete_message(first)  # the last one: drained, still held
                later = datetime.now(UTC) + timedelta(hours=1)
                sender.schedule_messages([Message("scheduled", session_id=f"e{r}") for _ in range(1000)], later)
                sender.send_messages(Message("now", session_id=f"e{r}"))
                barrier.wait(timeout=60)
                try:
                    got = receiver.receive_messages(max_message_count=1, max_wait_time=1)
                    _record(out_path, {"round": r, "holder": "renewed" if got else "empty"})
                except SessionLockLostError:
                    _record(out_path, {"round": r, "holder": "lost"})
                barrier.wait(timeout=60)


def child_racing_acceptor(root: str, queue: str, rounds: int, barrier: Any, out_path: str) -> None:
    """Per round: accept session e<r> by name as its holder renews or receives it."""
    with Namespace(root) as ns:
        for r in range(rounds):
            barrier.wait(timeout=60)
            try:
                with ns.get_queue_receiver(queue, session_id=f"e{r}"):
                    _record(out_path, {"round": r, "acceptor": "accepted"})
            except SessionCannotBeLockedError:
                _record(out_path, {"round": r, "acceptor": "refused"})
            barrier.wait(timeout=60)


def child_closing_renewed_holder(root: str, queue: str, rounds: int, barrier: Any, out_path: str) -> None:
    """Per round: end session c<r>'s hold, then close the receiver while a thread keeps renewing its session lock."""
    with Namespace(root) as ns:
        for r in range(rounds):
            receiver = ns.get_queue_receiver(queue, session_id=f"c{r}")
            (first,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
            receiver.complete_message(first)  # the last one: drained; the close deletes the row, a late renewal must not keep it
            session = receiver.session
            assert session is not None
            stop = threading.Event()
            t = renewing(session, stop)  # as an AutoLockRenewer's thread, racing close
            barrier.wait(timeout=60)
            time.sleep(0.003 * (r % 5))
            receiver.close()
            stop.set()
            t.join()
            _record(out_path, {"round": r, "holder": "closed"})
            barrier.wait(timeout=60)


def child_acceptor_after_close(root: str, queue: str, rounds: int, barrier: Any, out_path: str) -> None:
    """Per round: accept session c<r> by name as its holder closes: it must be free within a few seconds (lock: 60 s)."""
    with Namespace(root) as ns:
        for r in range(rounds):
            barrier.wait(timeout=60)
            give_up = time.monotonic() + 4.0
            got = "refused"
            while time.monotonic() < give_up:
                try:
                    with ns.get_queue_receiver(queue, session_id=f"c{r}"):
                        got = "accepted"
                        break
                except SessionCannotBeLockedError:
                    time.sleep(0.02)
            _record(out_path, {"round": r, "acceptor": got})
            barrier.wait(timeout=60)


def child_session_worker(root: str, queue: str, total: int, done: Any, barrier: Any, out_path: str, seed: int) -> None:
    """Race for sessions: accept next-available, receive one message at a time, complete (or sometimes abandon),
    sometimes give the session up mid-way. Reports holding intervals and every delivery and completion."""
    rng = random.Random(seed)
    intervals: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    give_up = time.monotonic() + 150
    with Namespace(root) as ns:
        barrier.wait(timeout=60)
        while done.value < total and time.monotonic() < give_up:
            try:
                r = ns.get_queue_receiver(queue, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.5)
            except (SessionCannotBeLockedError, OperationTimeoutError):
                continue
            assert r.session is not None
            sid = r.session.session_id
            start = time.time()  # after the accept committed: inside the true holding interval
            step = 0
            try:
                while True:
                    got = r.receive_messages(max_message_count=1, max_wait_time=0.1)
                    if not got:
                        break
                    (m,) = got
                    ev = {"sid": sid, "seq": m.sequence_number, "mid": m.message_id, "dc": m.delivery_count}
                    ev |= {"iv": len(intervals), "step": step, "op": "received"}
                    events.append(ev)
                    step += 1
                    roll = rng.random()
                    if roll < 0.1:
                        r.abandon_message(m)
                        events.append(ev | {"op": "abandoned", "step": step})
                    elif roll < 0.15:
                        events.append(ev | {"op": "left_locked", "step": step})
                        break  # give the session up holding the message: close must release it
                    else:
                        r.complete_message(m)
                        events.append(ev | {"op": "completed", "step": step})
                        with done.get_lock():
                            done.value += 1
                    step += 1
                    if rng.random() < 0.08:
                        break  # give the session up mid-way; another receiver continues it
            finally:
                end = time.time()  # before the release commit: still inside the true holding interval
                intervals.append({"sid": sid, "start": start, "end": end, "pid": os.getpid()})
                r.close()
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"intervals": intervals, "events": events}, f)


def child_transaction_then_hang(root: str, queue: str, marker: str, state_path: str) -> None:
    """Receive one message, then in a transaction complete it and send a marked batch; report, and hang in the block."""
    with Namespace(root) as ns, ns.get_queue_receiver(queue) as r, ns.get_queue_sender(queue) as s:
        got = []
        while not got:
            got = r.receive_messages(max_message_count=1, max_wait_time=1)
        with ns.transaction():
            r.complete_message(got[0])
            batch = [Message(f"{marker}-{i}", partition_key="k", application_properties={"batch": marker}) for i in range(50)]
            s.send_messages(batch)
            _record(state_path, {"phase": "inside", "settled": got[0].message_id})
            while True:
                time.sleep(1)


def child_transaction_loop(root: str, queue: str, prefix: str, state_path: str) -> None:
    """Forever: receive one message; in a transaction defer it and send 99 marked messages. Logs each phase.

    Deferring (not completing) keeps every message browsable, so each batch's count stays 0 or 99.
    """
    with Namespace(root) as ns, ns.get_queue_receiver(queue) as r, ns.get_queue_sender(queue) as s:
        n = 0
        while True:
            got = r.receive_messages(max_message_count=1, max_wait_time=1)
            if not got:
                continue
            marker = f"{prefix}-{n}"
            msgs = [Message(f"{marker}/{i}", partition_key="k", application_properties={"batch": marker}) for i in range(99)]
            with ns.transaction():
                r.defer_message(got[0])
                s.send_messages(msgs)
                _record(state_path, {"phase": "committing", "batch": marker, "settled": got[0].message_id})
            _record(state_path, {"phase": "done", "batch": marker})
            n += 1


# ---- exclusive session lock across processes ----------------------------------------------------------


def test_session_held_in_another_process_cannot_be_accepted(root: str, tmp_path: Path) -> None:
    """While a receiver in another process holds a session, neither a named nor a next-available accept gets it."""
    ns = Namespace(root)
    ns.create_queue("q", requires_session=True)  # default 60 s lock: only the close can free it here
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", session_id="s1", message_id=f"m{i}") for i in range(2)])
    ready, release = str(tmp_path / "ready"), str(tmp_path / "release")
    child = _start(child_hold_session, root, "q", "s1", ready, release)
    try:
        _wait_for(lambda: len(_lines(ready)) >= 1, what="the child to hold the session")
        assert _lines(ready)[0] == {"message_id": "m0", "delivery_count": 0}
        with pytest.raises(SessionCannotBeLockedError):
            ns.get_queue_receiver("q", session_id="s1")
        with pytest.raises(OperationTimeoutError):  # no free session: the SDK's pool loop ends on this
            ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.5)
        (info,) = ns.list_queue_sessions("q")
        assert info.locked_until_utc is not None
    finally:
        Path(release).touch()
        child.join(JOIN_S)
    assert child.exitcode == 0
    with ns.get_queue_receiver("q", session_id="s1") as r:  # released by the child's close, long before expiry
        (m,) = r.receive_messages(max_message_count=1, max_wait_time=2)
        assert (m.message_id, m.delivery_count) == ("m0", 1)


def test_killed_holder_session_lapses_at_expiry(root: str, tmp_path: Path) -> None:
    """A process killed while holding a session leaves the lock to lapse: after expiry another process takes over."""
    ns = Namespace(root)
    ns.create_queue("q", requires_session=True, lock_duration=timedelta(seconds=2))
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", session_id="s1", message_id=f"m{i}") for i in range(2)])
    ready = str(tmp_path / "ready")
    child = _start(child_hold_session, root, "q", "s1", ready, str(tmp_path / "never"))
    _wait_for(lambda: len(_lines(ready)) >= 1, what="the child to hold the session")
    os.kill(child.pid, signal.SIGKILL)
    child.join(JOIN_S)
    r = None
    give_up = time.monotonic() + 30
    while r is None:
        try:
            r = ns.get_queue_receiver("q", session_id="s1")
        except SessionCannotBeLockedError:
            assert time.monotonic() < give_up, "the killed holder's session lock never lapsed"
            time.sleep(0.2)
    with r:
        (m,) = r.receive_messages(max_message_count=1, max_wait_time=2)
        assert (m.message_id, m.delivery_count) == ("m0", 1)


def test_racing_accepts_lock_each_session_once(root: str, tmp_path: Path) -> None:
    """Processes racing to accept one named session, or the next available of two: each session goes to exactly one."""
    ns = Namespace(root)
    rounds = [("named", "s1"), ("next", None)]
    for queue, sessions in (("named", ["s1"]), ("next", ["s1", "s2"])):
        ns.create_queue(queue, requires_session=True)
        with ns.get_queue_sender(queue) as s:
            s.send_messages([Message("x", session_id=sid) for sid in sessions])
    n = 4
    barrier, release = CTX.Barrier(n), CTX.Event()
    out = str(tmp_path / "accepts")
    procs = [_start(child_try_accept, root, rounds, barrier, out, release) for _ in range(n)]
    try:
        _wait_for(lambda: len(_lines(out)) == n * len(rounds), what="every child to report")
    finally:
        release.set()
    _join_all(procs)
    won = defaultdict(list)
    for x in _lines(out):
        if x["won"] is not None:
            won[x["queue"]].append(x["won"])
    assert sorted(won["named"]) == ["s1"]
    assert sorted(won["next"]) == ["s1", "s2"]


# ---- many receivers over many sessions --------------------------------------------------------------------


def _race_rounds(
    root: str, tmp_path: Path, prefix: str, rounds: int, holder: Any, rival: Any, lock: timedelta | None = None
) -> dict[int, dict[str, str]]:
    """A session queue with one message in each session <prefix><round>; two children race round by round.

    Returns what each child recorded per round (every round recorded).
    """
    with Namespace(root) as ns:
        ns.create_queue("q", requires_session=True, **({"lock_duration": lock} if lock else {}))
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"{prefix}{r}", session_id=f"{prefix}{r}") for r in range(rounds)])
    out = str(tmp_path / "out.jsonl")
    barrier = CTX.Barrier(2)
    _join_all([_start(holder, root, "q", rounds, barrier, out), _start(rival, root, "q", rounds, barrier, out)])
    by_round: dict[int, dict[str, str]] = {}
    for line in _lines(out):
        by_round.setdefault(line.pop("round"), {}).update(line)
    assert len(by_round) == rounds
    return by_round


def _assert_the_holder_keeps_it_each_round(by_round: dict[int, dict[str, str]]) -> None:
    """Each round the holder of the drained session kept it ("renewed") and the other process was refused.

    SPEC §6: while a receiver holds the session lock no other receiver gets the session. A completion that
    drained a session used to end the hold, and the acceptor then won some rounds with the holder's lock valid.
    """
    assert all(got == {"holder": "renewed", "acceptor": "refused"} for got in by_round.values()), by_round


def test_a_drained_session_renewed_by_its_holder_while_another_process_accepts_it_stays_with_the_holder(
    root: str, tmp_path: Path
) -> None:
    """The holder of a drained session renewing while another process accepts it by name: the holder keeps it."""
    rounds = 30
    by_round = _race_rounds(root, tmp_path, "e", rounds, child_drained_holder, child_racing_acceptor)
    _assert_the_holder_keeps_it_each_round(by_round)


def test_a_drained_session_received_by_its_holder_while_another_process_accepts_it_stays_with_the_holder(
    root: str, tmp_path: Path
) -> None:
    """The holder of a drained session receiving a new message (1,000 scheduled ones ahead of it) while another
    process accepts the session by name: the holder gets the message, the other process is refused."""
    rounds = 12
    by_round = _race_rounds(root, tmp_path, "e", rounds, child_drained_receiver, child_racing_acceptor)
    _assert_the_holder_keeps_it_each_round(by_round)


def test_a_renewal_racing_close_in_another_thread_never_locks_the_session_again(root: str, tmp_path: Path) -> None:
    """A holder closing while its renewer thread renews, and another process accepting at once: the session is free.

    The closed holder's renewal can never make the session's row again after close (it would lock every
    other receiver out until the lock's expiry, here 60 s).
    """
    rounds = 12
    lock = timedelta(seconds=60)
    by_round = _race_rounds(root, tmp_path, "c", rounds, child_closing_renewed_holder, child_acceptor_after_close, lock)
    refused = [r for r, got in by_round.items() if got.get("acceptor") != "accepted"]
    assert not refused, f"rounds {refused}: the closed holder's renewal locked the session again"


@pytest.mark.parametrize(
    ("sessions", "per"), [pytest.param(16, 6, id="16x6"), pytest.param(40, 10, id="40x10", marks=pytest.mark.slow)]
)
def test_receivers_racing_over_many_sessions_keep_exclusivity_fifo_and_exactly_once(
    root: str, tmp_path: Path, sessions: int, per: int
) -> None:
    """4 racing processes: one holder per session at a time, strict per-session FIFO, exactly-once completion."""
    ns = Namespace(root)
    ns.create_queue("q", requires_session=True, lock_duration=timedelta(seconds=30))
    with ns.get_queue_sender("q") as s:
        for k in range(per):  # interleave sessions, several sessions per file
            s.send_messages([Message(f"s{i}-{k}", session_id=f"s{i}", message_id=f"s{i}-{k}") for i in range(sessions)])
    total = sessions * per
    n = 4
    done, barrier = CTX.Value("i", 0), CTX.Barrier(n)
    outs = [str(tmp_path / f"worker-{w}.json") for w in range(n)]
    procs = [_start(child_session_worker, root, "q", total, done, barrier, outs[w], 1000 + w) for w in range(n)]
    _join_all(procs)
    reports = [json.loads(Path(o).read_text()) for o in outs]

    # one holder per session at a time: the holding intervals of a session never overlap
    intervals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w, rep in enumerate(reports):
        for i, iv in enumerate(rep["intervals"]):
            intervals[iv["sid"]].append(iv | {"key": (w, i)})
    for sid, ivs in intervals.items():
        ivs.sort(key=lambda iv: iv["start"])
        for a, b in itertools.pairwise(ivs):
            assert a["end"] <= b["start"], f"session {sid} held by {a['pid']} and {b['pid']} at once"

    # merge every event into one order per session: by holding interval, then by step within it
    start_of = {iv["key"]: iv["start"] for ivs in intervals.values() for iv in ivs}
    per_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w, rep in enumerate(reports):
        for ev in rep["events"]:
            per_session[ev["sid"]].append(ev | {"order": (start_of[(w, ev["iv"])], ev["step"])})
    assert len(per_session) == sessions

    completed: list[str] = []
    for sid, evs in per_session.items():
        evs.sort(key=lambda e: e["order"])
        pending = sorted({e["seq"] for e in evs})
        assert len(pending) == per
        deliveries: dict[int, int] = defaultdict(int)
        done_seqs: list[int] = []
        for e in evs:
            if e["op"] == "received":
                # strict FIFO: each delivery is the session's earliest message not yet completed
                assert e["seq"] == pending[0], f"{sid}: delivered {e['seq']} while {pending[0]} was not completed"
                deliveries[e["seq"]] += 1
                assert e["dc"] == deliveries[e["seq"]] - 1, f"{sid}: delivery count {e['dc']} for delivery {deliveries[e['seq']]}"
            elif e["op"] == "completed":
                assert e["seq"] == pending.pop(0)
                done_seqs.append(e["seq"])
                completed.append(e["mid"])
        assert done_seqs == sorted(done_seqs)  # completion order is sequence order
        assert pending == []
    assert sorted(completed) == sorted(f"s{i}-{k}" for i in range(sessions) for k in range(per))  # each exactly once
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert all(info.locked_until_utc is None for info in ns.list_queue_sessions("q"))


# ---- transactions interrupted by SIGKILL -----------------------------------------------------------------------


def _batches(ns: Namespace, queue: str) -> tuple[dict[str, int], dict[str, str]]:
    """Stored messages per batch marker, and the state of every stored message by id."""
    counts: dict[str, int] = defaultdict(int)
    ids: dict[str, str] = {}
    for m in _peek_all(ns, queue):
        ids[m.message_id] = m.state
        props = m.application_properties or {}
        if "batch" in props:
            counts[props["batch"]] += 1
    return counts, ids


def test_process_killed_inside_transaction_block_leaves_nothing(root: str, tmp_path: Path) -> None:
    """SIGKILL inside `with ns.transaction():` applies none of its sends or settlements."""
    ns = Namespace(root)
    ns.create_queue("q", lock_duration=timedelta(seconds=1))
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("seed", message_id="seed", partition_key="k"))
    state = str(tmp_path / "state")
    child = _start(child_transaction_then_hang, root, "q", "b1", state)
    _wait_for(lambda: len(_lines(state)) >= 1, what="the child to be inside the transaction")
    os.kill(child.pid, signal.SIGKILL)
    child.join(JOIN_S)
    counts, ids = _batches(ns, "q")
    assert counts.get("b1", 0) == 0
    assert set(ids) == {"seed"}
    with ns.get_queue_receiver("q") as r:  # the seed's lock lapses; it was never completed
        got = []
        give_up = time.monotonic() + 20
        while not got and time.monotonic() < give_up:
            got = r.receive_messages(max_message_count=1, max_wait_time=0.5)
        assert [(m.message_id, m.delivery_count) for m in got] == [("seed", 1)]


KILL_ROUNDS = 30  # the loop ends after two kills inside a commit, usually within a few rounds


def test_process_killed_while_committing_transactions_leaves_whole_batches(root: str, tmp_path: Path) -> None:
    """SIGKILL during a transaction loop (mostly while committing): each batch and its settlement are all or nothing."""
    ns = Namespace(root)
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"seed{i}", message_id=f"seed{i}", partition_key="k") for i in range(8)])
    rng = random.Random(7)
    hit_commit = 0
    for rnd in range(KILL_ROUNDS):  # a kill lands inside a commit by chance: faster commits need more tries
        state = str(tmp_path / f"state-{rnd}")
        child = _start(child_transaction_loop, root, "q", f"r{rnd}", state)
        _wait_for(lambda state=state: any(x["phase"] == "done" for x in _lines(state)), what="a first committed batch")
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join(JOIN_S)
        log = _lines(state)
        counts, ids = _batches(ns, "q")
        committed = {x["batch"] for x in log if x["phase"] == "done"}
        for x in log:
            if x["phase"] != "committing":
                continue
            stored = counts.get(x["batch"], 0)
            assert stored in (0, 99), f"partial batch {x['batch']}: {stored} of 99 messages"
            # the settlement went with the sends: the received message is deferred exactly when the batch is there
            assert (ids[x["settled"]] == "deferred") == (stored == 99), f"batch {x['batch']} and its settlement disagree"
            if x["batch"] in committed:
                assert stored == 99
        if log[-1]["phase"] == "committing":
            hit_commit += 1
        if hit_commit >= 2:
            break
    assert hit_commit >= 1, "no kill landed between entering the commit and its end"
    counts, _ = _batches(ns, "q")
    assert all(c == 99 for c in counts.values()), dict(counts)
