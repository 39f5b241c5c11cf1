"""Crash safety (docs/semantics.md §10): a process SIGKILLed at any point loses no accepted message, leaves no half-applied
batch, and its locks lapse at expiry.

Each iteration starts a child process that loops over random operations on a partitioned queue "q" and a
queue "fwd" that auto-forwards to "q" (sends of keyed and unkeyed batches, receive + complete / abandon /
dead-letter, dead-letter receives, run_maintenance) and journals them to an fsync'ed file: an intent line
before each call and an outcome line after it returns. The parent SIGKILLs the child after a random delay.
After all iterations the namespace must agree with the journals.

Run as a script (`python test_crash_safety.py child <root> <journal> <seed>`) it is the child.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from procs import drain_all, peek_all

from sparkqueue import Message, Namespace, ReceiveMode, SubQueue
from sparkqueue.errors import MessageLockLostError

HERE = Path(__file__).resolve().parent
LOCK = timedelta(seconds=2)
KEYS = [None, None, "k1", "k2", "k3", "k4", "k5", "k6"]


# ---- the child ------------------------------------------------------------------------------------


class Journal:
    """Append-only, fsync'ed: a line written here survives the SIGKILL that may follow."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the child

    def write(self, *parts: object) -> None:
        self._f.write(" ".join(str(p) for p in parts) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())


def child(root: str, journal_path: str, seed: int) -> None:
    """Loop over random operations forever, journaling each; the parent kills this process."""
    rng = random.Random(seed)
    j = Journal(journal_path)
    ns = Namespace(root)
    senders = {q: ns.get_queue_sender(q) for q in ("q", "fwd")}
    receiver = ns.get_queue_receiver("q")
    dead = ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER)
    j.write("ready")
    n = 0
    while True:
        n += 1
        op = rng.choices(["send", "send_fwd", "receive", "receive_dlq", "maintain"], weights=[4, 2, 5, 1, 0.4])[0]
        if op in ("send", "send_fwd"):
            queue = "q" if op == "send" else "fwd"
            batch = f"{seed}.{n}"
            size = rng.randint(1, 12)
            msgs = [
                Message(
                    f"{batch}-{k}",
                    message_id=f"{batch}-{k}",
                    partition_key=rng.choice(KEYS),
                    application_properties={"batch": batch},
                )
                for k in range(size)
            ]
            j.write("B", batch, size, queue)  # intent: this batch may or may not be stored
            senders[queue].send_messages(msgs)
            j.write("S", batch)  # acknowledged: every message of the batch was accepted
        elif op in ("receive", "receive_dlq"):
            r = receiver if op == "receive" else dead
            got = r.receive_messages(max_message_count=rng.randint(1, 8), max_wait_time=0.1)
            if got:
                j.write("R", *(m.message_id for m in got))
            for m in got:
                action = "complete" if op == "receive_dlq" else rng.choices(["complete", "abandon", "dead"], weights=[7, 2, 1])[0]
                if action == "complete":
                    j.write("c", m.message_id)  # intent: this message may be completed from now on
                    try:
                        r.complete_message(m)
                    except MessageLockLostError:
                        j.write("L", m.message_id)  # not completed: the lock had lapsed
                        continue
                    j.write("C", m.message_id)
                elif action == "abandon":
                    with contextlib.suppress(MessageLockLostError):
                        r.abandon_message(m)
                else:
                    with contextlib.suppress(MessageLockLostError):
                        r.dead_letter_message(m, reason="crash-test")
        else:
            ns.run_maintenance(vacuum_retention=timedelta(0))
            j.write("M")


# ---- the parent ------------------------------------------------------------------------------------


@dataclass
class History:
    """What the journals say, over all iterations."""

    batches: dict[str, tuple[int, str]] = field(default_factory=dict)  # batch -> (size, queue)
    acked: set[str] = field(default_factory=set)  # batches whose send returned
    completed: set[str] = field(default_factory=set)  # ids whose complete returned
    in_flight_completes: set[str] = field(default_factory=set)  # complete called, outcome unknown (killed)
    lost_locks: int = 0
    maintenance_runs: int = 0
    killed_mid_send: int = 0

    def ids(self, batch: str) -> list[str]:
        return [f"{batch}-{k}" for k in range(self.batches[batch][0])]

    def read(self, path: Path) -> None:
        """Fold one child's journal in; a torn last line (killed mid-write) is ignored."""
        lines = path.read_text(encoding="utf-8").split("\n")
        pending_complete: str | None = None
        pending_batch: str | None = None
        for line in lines[:-1]:  # the text after the last newline is a torn write, if anything
            op, *args = line.split()
            if op == "B":
                self.batches[args[0]] = (int(args[1]), args[2])
                pending_batch = args[0]
            elif op == "S":
                self.acked.add(args[0])
                pending_batch = None
            elif op == "c":
                pending_complete = args[0]
            elif op == "C":
                self.completed.add(args[0])
                pending_complete = None
            elif op == "L":
                self.lost_locks += 1
                pending_complete = None
            elif op == "M":
                self.maintenance_runs += 1
        if pending_complete is not None:
            self.in_flight_completes.add(pending_complete)
        if pending_batch is not None:
            self.killed_mid_send += 1


def _start_child(root: str, journal: Path, seed: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "child", root, str(journal), str(seed)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=HERE.parent,
        )


def _wait_ready(proc: subprocess.Popen, journal: Path, log: Path, timeout_s: float = 120.0) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if journal.exists() and journal.read_text(encoding="utf-8").startswith("ready\n"):
            return
        if proc.poll() is not None:
            pytest.fail(f"child exited with {proc.returncode} before it was ready:\n{log.read_text()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("child did not get ready")


def _present(ns: Namespace) -> Counter[str]:
    """message_id -> copies held anywhere: both queues, main and dead-letter sub-queues, any state."""
    held: Counter[str] = Counter()
    for queue in ("q", "fwd"):
        for sub_queue in (None, SubQueue.DEAD_LETTER):
            with ns.get_queue_receiver(queue, sub_queue=sub_queue) as r:
                held.update(m.message_id for m in peek_all(r, batch=500))
    return held


def _crash_loop(root: str, tmp: Path, *, min_iterations: int, max_iterations: int, budget_s: float, seed: int) -> History:
    """Run children and SIGKILL each after a random delay; returns the combined journals."""
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=LOCK, max_delivery_count=1000)
        ns.create_queue("fwd", lock_duration=LOCK, forward_to="q")
    rng = random.Random(seed)
    history = History()
    start = time.monotonic()
    for i in range(max_iterations):
        if i >= min_iterations and time.monotonic() - start > budget_s:
            break
        journal, log = tmp / f"journal-{i}", tmp / f"child-{i}.log"
        proc = _start_child(root, journal, seed * 1000 + i, log)
        _wait_ready(proc, journal, log)
        time.sleep(rng.uniform(0.05, 2.0))
        if proc.poll() is not None:
            pytest.fail(f"child {i} exited with {proc.returncode} on its own:\n{log.read_text()}")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        history.read(journal)
    return history


def _check_conservation(root: str, history: History) -> None:
    with Namespace(root) as ns:
        ns.forward_pending_messages()  # finish any move a killed child left between its two steps
        held = _present(ns)
        present = set(held)
        sent = {i for b in history.batches for i in history.ids(b)}
        acked = {i for b in history.acked for i in history.ids(b)}
        may_be_gone = history.completed | history.in_flight_completes

        assert not [i for i, n in held.items() if n > 1], "a message is held twice"
        assert present <= sent, "a message nobody sent is held"
        assert not present & history.completed, "a completed message is still held"
        missing = acked - present - may_be_gone
        assert not missing, f"acknowledged messages lost: {sorted(missing)[:10]}"
        for b in history.batches:  # all of a batch, or none of it (for batches whose send did not return)
            accounted = [i in present or i in may_be_gone for i in history.ids(b)]
            assert all(accounted) or (b not in history.acked and not any(accounted)), f"batch {b} is half applied"

        with ns.get_queue_receiver("q") as r:
            main = Counter(m.message_id for m in peek_all(r, batch=500))
        time.sleep(LOCK.total_seconds() + 0.5)  # the killed children's locks lapse
        with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
            taken = Counter(m.message_id for m in drain_all(r, batch=500))
        assert taken == main, "a message stayed locked after its lock expired"


def _run(tmp_path: Path, **kw) -> History:
    root = str(tmp_path / "ns")
    journals = tmp_path / "journals"
    journals.mkdir()
    history = _crash_loop(root, journals, **kw)
    assert history.acked, "no send was ever acknowledged: the test exercised nothing"
    _check_conservation(root, history)
    return history


def test_sigkill_at_random_points_loses_nothing_and_applies_batches_whole(tmp_path: Path) -> None:
    """A process SIGKILLed at random points loses no accepted message and leaves no half-applied batch (§10)."""
    h = _run(tmp_path, min_iterations=6, max_iterations=40, budget_s=20.0, seed=7)  # the soak below runs longer
    print(
        f"batches={len(h.batches)} acked={len(h.acked)} completed={len(h.completed)} "
        f"in-flight completes={len(h.in_flight_completes)} killed mid-send={h.killed_mid_send} "
        f"lost locks={h.lost_locks} maintenance runs={h.maintenance_runs}"
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigkill_soak_many_iterations(tmp_path: Path) -> None:
    """The same rule over hundreds of SIGKILLs (slow)."""
    h = _run(tmp_path, min_iterations=100, max_iterations=400, budget_s=480.0, seed=11)
    assert h.killed_mid_send > 0


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "child":
    child(sys.argv[2], sys.argv[3], int(sys.argv[4]))


# A sender whose log entry lands, then stops (SIGSTOP to itself) before it hears back: a paused process, or on an
# object store a reply that came late. argv: root, flag file (present: stop at the next entity entry), result file.
STOPS_AFTER_ITS_PUT = r"""
import contextlib, json, os, signal, sys
import sparkqueue.storage.store as store
from sparkqueue import Message, Namespace

root, flag, out = sys.argv[1:4]
staged = store.LocalStore.staged

@contextlib.contextmanager
def stopping(self, data, folder):
    with staged(self, data, folder) as put:
        def put_then_stop(path):
            landed = put(path)
            if landed and "/entities/" in self.root and os.path.exists(flag):
                os.unlink(flag)
                os.kill(os.getpid(), signal.SIGSTOP)
            return landed
        yield put_then_stop

store.LocalStore.staged = stopping
with Namespace(root) as ns, ns.get_queue_sender("q") as s:
    try:
        s.send_messages([Message(f"late-{i}", message_id=f"late-{i}") for i in range(5)])
        result = "sent"
    except Exception as exc:
        result = type(exc).__name__
with open(out, "w") as f:
    f.write(result)
"""

# Creates the queue with a short log retention (its table property), so a trim passes the stopped sender quickly.
SHORT_RETENTION_QUEUE = r"""
import sys
import sparkqueue.storage.table as table
from sparkqueue import Namespace

table.LOG_RETENTION = "interval 4 seconds"
with Namespace(sys.argv[1]) as ns:
    ns.create_queue("q")
"""


def test_a_send_whose_reply_came_after_others_trimmed_past_it_is_never_stored_twice(tmp_path: Path) -> None:
    """The sender's entry landed in turn; while it was stopped, its messages were completed, the log checkpointed and
    trimmed past it. It took that for a lost race and sent again: every message stored and delivered twice. Now it
    cannot tell, and says so (StorageError), and stores nothing more."""
    root, flag, out = str(tmp_path / "ns"), tmp_path / "flag", tmp_path / "result"
    subprocess.run([sys.executable, "-c", SHORT_RETENTION_QUEUE, root], check=True, timeout=120)
    flag.touch()
    sender = subprocess.Popen([sys.executable, "-c", STOPS_AFTER_ITS_PUT, root, str(flag), str(out)])
    try:
        deadline = time.monotonic() + 60
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with Namespace(root) as ns:
            first = _complete_all(ns)
            time.sleep(5)  # older than the retention
            with ns.get_queue_sender("q") as s:
                for i in range(3):
                    s.send_messages(Message(f"after-{i}", message_id=f"after-{i}"))
            ns.run_maintenance()  # checkpoint at the head, trim what is older than the retention
            sender.send_signal(signal.SIGCONT)
            assert sender.wait(timeout=120) == 0
            second = _complete_all(ns)
    finally:
        with contextlib.suppress(ProcessLookupError):
            sender.send_signal(signal.SIGCONT)
        sender.wait(timeout=120)
    assert out.read_text() == "StorageError"  # the outcome is unknown to it: neither "sent" nor repeated
    assert sorted(first) == [f"late-{i}" for i in range(5)]
    assert sorted(second) == [f"after-{i}" for i in range(3)]


def _complete_all(ns: Namespace) -> list[str]:
    """Receive and complete everything in queue "q"; the message ids."""
    with ns.get_queue_receiver("q") as r:
        got = drain_all(r)
        r.complete_messages(got)
    return [str(m.message_id) for m in got]
