"""Auto-forwarding survives SIGKILL (docs/semantics.md §9, §10): every acknowledged message ends up exactly once, none doubled.

Child processes send batches to a queue that forwards (src -> mid -> dst), so each send also forwards
in the child. They are killed with SIGKILL at random moments, also between a destination append and
the source delete. After `forward_pending_messages()` every message whose send returned must be in
exactly one place, and no message may be anywhere twice. A second test does the same for dead-letter
forwarding: children dead-letter messages (so each dead-lettering forwards) and are killed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import peek_all

from sparkqueue import NEXT_AVAILABLE_SESSION, Message, Namespace, ReceiveMode, SubQueue
from sparkqueue.errors import InvalidOperationError, OperationTimeoutError

CHAIN = ("src", "mid", "dst")

# A child: send random batches (keyed and unkeyed, so a batch spans partitions) until killed;
# after each send returns, append its message ids to the ack file with one write() (atomic on kill).
CHILD = r"""
import os, random, sys
from sparkqueue import Message, Namespace

root, queue, ack_path, tag, seed = sys.argv[1:6]
rnd = random.Random(int(seed))
fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
with Namespace(root) as ns, ns.get_queue_sender(queue) as sender:
    os.write(fd, b"ready\n")
    b = 0
    while True:
        n = rnd.randint(1, 25)
        msgs = [
            Message(f"{tag}.{b}.{i}", message_id=f"{tag}.{b}.{i}",
                    partition_key=f"k{rnd.randrange(40)}" if rnd.random() < 0.5 else None)
            for i in range(n)
        ]
        sender.send_messages(msgs)
        os.write(fd, (" ".join(m.message_id for m in msgs) + "\n").encode())
        b += 1
"""


# A child: receive messages and dead-letter them in random order (each dead-lettering forwards) until killed.
DEAD_LETTER_CHILD = r"""
import os, random, sys
from sparkqueue import Namespace
from sparkqueue.errors import MessageLockLostError

root, queue, ready_path, seed = sys.argv[1:5]
rnd = random.Random(int(seed))
with Namespace(root) as ns, ns.get_queue_receiver(queue) as receiver:
    fd = os.open(ready_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"ready\n")
    while True:
        got = receiver.receive_messages(max_message_count=rnd.randint(1, 8), max_wait_time=0.5)
        rnd.shuffle(got)
        for m in got:
            try:
                if rnd.random() < 0.85:
                    receiver.dead_letter_message(m, reason="crash-test")
                else:
                    receiver.abandon_message(m)
            except MessageLockLostError:
                pass  # the short lock lapsed under load; another receiver may take the message
"""


# A child that dies (SIGKILL to itself) at the one point the random kills may miss: after the copies were
# appended to the destination, before the source settles its originals (docs/semantics.md §9).
DIES_BETWEEN_APPEND_AND_SETTLE = r"""
import os, signal, sys
from sparkqueue import Message, Namespace
from sparkqueue.model import forwarding

root, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
appended, settle, deliver = [], forwarding._settle_source, forwarding._deliver
forwarding._deliver = lambda *a, **k: (deliver(*a, **k), appended.append(True))[0]
forwarding._settle_source = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL) if appended else settle(*a, **k)
with Namespace(root) as ns:
    if mode == "pending":  # forward what waits at the source (forward_to was set after the sends)
        ns.forward_pending_messages()
    elif mode == "send":
        with ns.get_queue_sender("src") as sender:
            sender.send_messages([Message(f"s{i}", message_id=f"s{i}", partition_key="k") for i in range(n)])
    else:
        with ns.get_queue_receiver("src") as receiver:
            for m in receiver.receive_messages(max_message_count=n, max_wait_time=5):
                receiver.dead_letter_message(m, reason="crash-test")  # the first one forwards, and dies
print("not killed", flush=True)
"""


# Sets a queue's forward_to and dies (SIGKILL) right after the update's commit, before it forwards what waits.
UPDATE_THEN_DIE = r"""
import os, signal, sys
from sparkqueue import Namespace
from sparkqueue.broker.core import Broker

Broker.forward_after_route_change = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
with Namespace(sys.argv[1]) as ns:
    ns.update_queue(ns.get_queue(sys.argv[2]), forward_to=sys.argv[3])
"""


def set_forward_to_leaving_messages_waiting(root: str, queue: str, destination: str) -> None:
    """Set forward_to in a process killed before it forwards: the queue's messages wait for the next forwarder."""
    done = subprocess.run([sys.executable, "-c", UPDATE_THEN_DIE, root, queue, destination], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]


def acked_ids(path: Path) -> list[str]:
    """Message ids of every send that returned (complete lines only)."""
    if not path.exists():
        return []
    out: list[str] = []
    for line in path.read_text().split("\n")[:-1]:
        if line != "ready":
            out.extend(line.split())
    return out


def everywhere(ns: Namespace) -> tuple[Counter[str], Counter[str]]:
    """(copies of each message id in all main queues of the chain, copies in all their dead-letter sub-queues)."""
    return everywhere_of(ns, CHAIN)


def everywhere_of(ns: Namespace, queues: tuple[str, ...], session_id: str | None = None) -> tuple[Counter[str], Counter[str]]:
    """(copies of each message id in the queues' main sub-queues, copies in their dead-letter sub-queues).

    `session_id`: the queues require sessions; their main sub-queues are browsed in that session.
    """
    main: Counter[str] = Counter()
    dead: Counter[str] = Counter()
    for q in queues:
        with ns.get_queue_receiver(q, session_id=session_id) as r:
            main.update(m.message_id for m in peek_all(r, batch=500))
        with ns.get_queue_receiver(q, sub_queue=SubQueue.DEAD_LETTER) as r:
            dead.update(m.message_id for m in peek_all(r, batch=500))
    return main, dead


def wait_ready(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    """Wait until the child opened its namespace (bounded)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if path.exists() and path.read_text().startswith("ready\n"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.05)
    raise AssertionError("child did not start in time")


def check_exactly_once(ns: Namespace, acked: set[str]) -> Counter[str]:
    """Every acknowledged id is in exactly one place; no id anywhere twice; nothing dead-lettered."""
    main, dead = everywhere(ns)
    assert dead == Counter(), f"unexpected dead letters: {dict(dead)}"
    doubled = {k: v for k, v in main.items() if v > 1}
    assert not doubled, f"{len(doubled)} message(s) stored more than once, e.g. {list(doubled.items())[:5]}"
    missing = acked - set(main)
    assert not missing, f"{len(missing)} acknowledged message(s) lost, e.g. {sorted(missing)[:5]}"
    return main


def run_crash_iterations(root: str, tmp: Path, iterations: int, children: int, seed: int) -> dict[str, int]:
    """Spawn senders, SIGKILL them at random moments, recover and check after some iterations; return stats."""
    rnd = random.Random(seed)
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("mid", forward_to="dst", enable_partitioning=False)
        ns.create_queue("src", forward_to="mid")
    acks: list[Path] = []
    stats = Counter[str]()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for it in range(iterations):
        procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        for c in range(children):
            ack = tmp / f"ack-{it}-{c}.txt"
            acks.append(ack)
            args = [sys.executable, "-c", CHILD, root, "src", str(ack), f"i{it}c{c}", str(rnd.randrange(1 << 30))]
            procs.append((subprocess.Popen(args, stderr=subprocess.PIPE, env=env), ack))
        for proc, ack in procs:
            wait_ready(ack, proc)
        for proc, _ in sorted(procs, key=lambda _: rnd.random()):
            time.sleep(rnd.uniform(0.0, 1.5))
            alive = proc.poll() is None
            assert alive, f"child died on its own: {proc.stderr.read().decode() if proc.stderr else ''}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.stderr is not None
            proc.stderr.close()
            stats["kills"] += 1
        acked = {i for a in acks for i in acked_ids(a)}
        with Namespace(root) as ns:
            main, _ = everywhere(ns)
            stats["doubled_before_recovery"] += sum(1 for v in main.values() if v > 1)
            if it % 2 == 1 or it == iterations - 1:  # other iterations leave the recovery to the next senders
                ns.forward_pending_messages()
                final = check_exactly_once(ns, acked)
    with Namespace(root) as ns:
        for q in ("src", "mid"):
            assert ns.get_queue_runtime_properties(q).total_message_count == 0, f"{q} still holds messages"
        assert ns.get_queue_runtime_properties("dst").total_message_count == len(final)
    stats["acked"] = len(acked)
    stats["stored"] = len(final)
    stats["stored_not_acked"] = len(set(final) - acked)  # sends killed after their commit, before returning
    return dict(stats)


@pytest.mark.parametrize("mode", ["send", "dead-letter"])
def test_a_forwarder_killed_between_append_and_settle_leaves_each_message_once_after_recovery(root: str, mode: str) -> None:
    """The crash window of a two-table move, hit every time: copies at the destination, originals still at the source.

    Before recovery the messages are in both places (what the random-kill tests hit only by chance);
    `forward_pending_messages()` then only settles the originals: each message ends up once.
    """
    n = 20 if mode == "send" else 1  # a send forwards its batch at once; a dead-lettering forwards that message
    with Namespace(root) as ns:
        ns.create_queue("dst")
        if mode == "send":
            ns.create_queue("src", forward_to="dst")
        else:
            ns.create_queue("src", forward_dead_lettered_messages_to="dst")
            with ns.get_queue_sender("src") as s:
                s.send_messages([Message(f"s{i}", message_id=f"s{i}", partition_key="k") for i in range(n)])
    args = [sys.executable, "-c", DIES_BETWEEN_APPEND_AND_SETTLE, root, mode, str(n)]
    done = subprocess.run(args, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    ids = {f"s{i}" for i in range(n)}
    source = SubQueue.DEAD_LETTER if mode == "dead-letter" else None
    with Namespace(root) as ns:
        with ns.get_queue_receiver("dst") as r:
            assert Counter(m.message_id for m in peek_all(r, batch=100)) == Counter(dict.fromkeys(ids, 1))
        with ns.get_queue_receiver("src", sub_queue=source) as r:
            assert {m.message_id for m in peek_all(r, batch=100)} == ids  # the originals: not yet settled
        ns.forward_pending_messages()
        main, dead = everywhere_of(ns, ("src", "dst"))
        assert main == Counter(dict.fromkeys(ids, 1)) and dead == Counter()
        assert ns.get_queue_runtime_properties("src").total_message_count == 0


@pytest.mark.parametrize("then", ["removed", "changed"])
def test_originals_a_killed_forwarder_delivered_are_settled_when_forward_to_is_removed_or_changed(root: str, then: str) -> None:
    """Only the old destination records that they went: the update settles them there, so none is received or sent twice."""
    n = 20
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("other")
        ns.create_queue("src", forward_to="dst")
    args = [sys.executable, "-c", DIES_BETWEEN_APPEND_AND_SETTLE, root, "send", str(n)]
    done = subprocess.run(args, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    ids = Counter(f"s{i}" for i in range(n))
    with Namespace(root) as ns:
        ns.update_queue(ns.get_queue("src"), forward_to=None if then == "removed" else "other")
        ns.forward_pending_messages()
        assert everywhere_of(ns, ("dst",)) == (ids, Counter())
        assert everywhere_of(ns, ("src", "other")) == (Counter(), Counter())
        with ns.get_queue_sender("src") as s:  # the route as it is now holds for later messages
            s.send_messages(Message("later", message_id="later"))
        where = "src" if then == "removed" else "other"
        assert everywhere_of(ns, (where,)) == (Counter({"later": 1}), Counter())


def test_an_expired_message_stays_dead_lettered_when_a_forwarder_is_killed_after_its_append(root: str) -> None:
    """The copies' fence covered an expired message that stayed at the source: recovery took it as delivered and
    removed it, so a message owed to the dead-letter queue was lost. Expiry now commits before anything travels."""
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src", enable_partitioning=False, dead_lettering_on_message_expiration=True)
        with ns.get_queue_sender("src") as s:
            s.send_messages(
                [Message("expiring", message_id="e", time_to_live=timedelta(seconds=1)), Message("kept", message_id="k")]
            )
        time.sleep(1.2)
    set_forward_to_leaving_messages_waiting(root, "src", "dst")
    done = subprocess.run(
        [sys.executable, "-c", DIES_BETWEEN_APPEND_AND_SETTLE, root, "pending", "0"], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    with Namespace(root) as ns:
        ns.forward_pending_messages()
        main, dead = everywhere_of(ns, ("src", "dst"))
        assert (main, dead) == (Counter({"k": 1}), Counter({"e": 1}))
        with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
            assert [m.dead_letter_reason for m in peek_all(r)] == ["TTLExpiredException"]


def test_forwarding_exactly_once_under_sigkill(root: str, tmp_path: Path) -> None:
    """Senders that forward as they go, SIGKILLed at random points: acknowledged messages are kept exactly once."""
    stats = run_crash_iterations(root, tmp_path, iterations=4, children=2, seed=random.randrange(1 << 30))
    print("crash stats:", stats)
    assert stats["kills"] == 8
    assert stats["acked"] > 0


@pytest.mark.slow
def test_forwarding_exactly_once_under_sigkill_soak(root: str, tmp_path: Path) -> None:
    """Soak: many more kill iterations of forwarding senders keep exactly-once delivery."""
    stats = run_crash_iterations(root, tmp_path, iterations=16, children=3, seed=random.randrange(1 << 30))
    print("crash stats:", stats)
    assert stats["acked"] > 0


def test_dead_letter_forwarding_exactly_once_under_sigkill(root: str, tmp_path: Path) -> None:
    """Receivers dead-lettering into a forwarded dead-letter queue, SIGKILLed at random: every message stays exactly once."""
    rnd = random.Random(random.randrange(1 << 30))
    n = 400
    with Namespace(root) as ns:
        ns.create_queue("target")
        ns.create_queue("src", forward_dead_lettered_messages_to="target", lock_duration=timedelta(seconds=2))
        sender = ns.get_queue_sender("src")
        for start in range(0, n, 100):
            sender.send_messages(
                [Message(f"{i}", message_id=f"m{i}", partition_key=f"k{i % 7}") for i in range(start, start + 100)]
            )
    waiting = 0
    for it in range(3):
        procs = []
        for c in range(2):
            ready = tmp_path / f"ready-{it}-{c}.txt"
            args = [sys.executable, "-c", DEAD_LETTER_CHILD, root, "src", str(ready), str(rnd.randrange(1 << 30))]
            procs.append((subprocess.Popen(args, stderr=subprocess.PIPE), ready))
        for proc, ready in procs:
            wait_ready(ready, proc)
        for proc, _ in procs:
            time.sleep(rnd.uniform(0.0, 1.5))
            assert proc.poll() is None, f"child died on its own: {proc.stderr.read().decode() if proc.stderr else ''}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.stderr is not None
            proc.stderr.close()
        with Namespace(root) as ns, ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
            waiting += len(peek_all(r, batch=500))  # dead letters a killed child left unforwarded (or mid-claim)
    with Namespace(root) as ns:
        ns.forward_pending_messages()
        places = Counter[str]()
        for q, sub_queue in (("src", None), ("src", SubQueue.DEAD_LETTER), ("target", None), ("target", SubQueue.DEAD_LETTER)):
            with ns.get_queue_receiver(q, sub_queue=sub_queue) as r:
                places.update(m.message_id for m in peek_all(r, batch=500))
        assert places == Counter({f"m{i}": 1 for i in range(n)})
        assert ns.get_queue_runtime_properties("src").dead_letter_message_count == 0
        forwarded = ns.get_queue_runtime_properties("target").active_message_count
    print("dead-letter crash stats:", {"forwarded": forwarded, "dead_letters_left_by_killed_children": waiting})
    assert forwarded > 0


# A forwarder that holds its run (read while every message was live) for a while before its append.
SLOW_FORWARDER = r"""
import sys, time
from sparkqueue import Namespace
from sparkqueue.model import forwarding

deliver = forwarding._deliver
def slow(*a, **k):
    print("holds its run", flush=True)
    time.sleep(float(sys.argv[2]))
    return deliver(*a, **k)
forwarding._deliver = slow
with Namespace(sys.argv[1], create=False) as ns:
    print("ready", flush=True)
    sys.stdin.readline()  # the messages are sent: forward them
    ns.forward_pending_messages()
print("done", flush=True)
"""


@pytest.mark.slow  # ~15 s of waiting for an expiry between two forwarders
def test_a_forwarder_that_read_its_run_before_an_expiry_removes_no_dead_letter(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forwarder X reads m0, m1, m2 while m1 is live and stalls before its append; forwarder Y then expires m1 into the
    dead-letter queue and forwards the others. X's stale source commit removed m1's dead letter: lost, with no crash."""
    from sparkqueue.broker.core import Broker

    monkeypatch.setattr(Broker, "forward_now", lambda *a, **k: None)  # the sends leave forwarding to X and Y
    ttl = 10.0
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src", forward_to="dst", dead_lettering_on_message_expiration=True, enable_partitioning=False)
        args = [sys.executable, "-c", SLOW_FORWARDER, root, str(ttl + 2)]
        x = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert x.stdin is not None and x.stdout is not None
            assert x.stdout.readline().strip() == "ready"  # started before the send: its start costs none of m1's TTL
            with ns.get_queue_sender("src") as s:
                expiring = Message("m1", message_id="m1", time_to_live=timedelta(seconds=ttl))
                s.send_messages([Message("m0", message_id="m0"), expiring, Message("m2", message_id="m2")])
            sent = time.monotonic()
            x.stdin.write("go\n")
            x.stdin.flush()
            assert x.stdout.readline().strip() == "holds its run"
            assert time.monotonic() - sent < ttl, "X read its run after m1 expired: the race was not set up"
            time.sleep(max(0.0, sent + ttl + 0.3 - time.monotonic()))
            ns.forward_pending_messages()  # Y: expires m1, forwards m0 and m2
        finally:
            out, _ = x.communicate(timeout=120)
        assert x.returncode == 0 and "done" in out
        main, dead = everywhere_of(ns, ("src", "dst"))
        assert main == Counter({"m0": 1, "m2": 1})
        assert dead == Counter({"m1": 1})


# A receiver that dead-letters messages into a forwarded dead-letter queue and dies (SIGKILL to itself) right after
# the forwarder claimed them, before any copy reached the destination.
DIES_AFTER_CLAIM = r"""
import os, signal, sys
from sparkqueue import Namespace
from sparkqueue.model import forwarding

forwarding._deliver = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
with Namespace(sys.argv[1]) as ns, ns.get_queue_receiver("src") as receiver:
    for m in receiver.receive_messages(max_message_count=1, max_wait_time=5):
        receiver.dead_letter_message(m, reason="crash-test")
print("not killed", flush=True)
"""


def _dead_letter_forwarding_pair(root: str) -> None:
    """Queue src (2 s locks) forwarding its dead letters to dst; s0 and s1 forwarded already, s2 still in src."""
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src", forward_dead_lettered_messages_to="dst", lock_duration=timedelta(seconds=2))
        with ns.get_queue_sender("src") as s:
            s.send_messages([Message(f"s{i}", message_id=f"s{i}", partition_key="k") for i in range(3)])
        with ns.get_queue_receiver("src") as r:
            for m in r.receive_messages(max_message_count=2, max_wait_time=5):
                r.dead_letter_message(m, reason="before")  # forwarded at once: dst holds s0, s1


@pytest.mark.parametrize("gone", ["destination", "route", "disabled"])
def test_dead_letters_a_killed_forwarder_claimed_become_receivable_when_their_route_is_gone(root: str, gone: str) -> None:
    """A forwarder SIGKILLed after claiming dead letters left them unreceivable for good once the destination was
    deleted or disabled (or the route removed): nothing ever finished or released the claim. A claim a lock duration
    old is now cancelled by the next forward (maintenance runs one), and the dead letters are receivable again."""
    _dead_letter_forwarding_pair(root)
    done = subprocess.run([sys.executable, "-c", DIES_AFTER_CLAIM, root], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    with Namespace(root) as ns:
        if gone == "destination":
            ns.delete_queue("dst")
        else:
            props = ns.get_queue("src")
            if gone == "route":
                props.forward_dead_lettered_messages_to = None
                ns.update_queue(props)
            else:
                ns.update_queue(ns.get_queue("dst"), status="Disabled")
        ns.forward_pending_messages()  # too early: the claim has not lapsed, its forwarder may be at work
        with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
            assert [m.message_id for m in peek_all(r)] == ["s2"]
            assert r.receive_messages(max_message_count=10, max_wait_time=0.5) == []  # claimed: no receiver takes it
            time.sleep(2.1)  # the claim lapses
            ns.forward_pending_messages()
            assert [m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=5)] == ["s2"]


# A process that stops (SIGSTOP to itself) at one point of forwarding, prints "paused" there, and "resumed" at the end.
# argv: root, the forwarding function to stop in ("_deliver": before it runs; "_record_cancel": after it ran), and
# what to do: "dead-letter" (receive one message of src and dead-letter it, which forwards it), "forward"
# (forward_pending_messages), or "go-forward" (print "ready", wait for a line on stdin, then forward).
PAUSING = r"""
import os, signal, sys
from sparkqueue import Namespace
from sparkqueue.model import forwarding

root, point, action = sys.argv[1:4]
real = getattr(forwarding, point)
def paused(*a, **k):
    outcome = real(*a, **k) if point == "_record_cancel" else None
    print("paused", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return outcome if point == "_record_cancel" else real(*a, **k)
setattr(forwarding, point, paused)
with Namespace(root) as ns:
    if action == "dead-letter":
        with ns.get_queue_receiver("src") as receiver:
            for m in receiver.receive_messages(max_message_count=1, max_wait_time=5):
                receiver.dead_letter_message(m, reason="paused")
    else:
        if action == "go-forward":
            print("ready", flush=True)
            sys.stdin.readline()
        ns.forward_pending_messages()
print("resumed", flush=True)
"""


def resume(child: subprocess.Popen[str]) -> str:
    """Let a stopped PAUSING child go on (SIGCONT) and wait for it: it must exit 0. Returns what it printed since."""
    child.send_signal(signal.SIGCONT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    return out


def pausing(root: str, point: str, action: str, **popen: Any) -> subprocess.Popen[str]:
    """Start the PAUSING child (text pipes for stdout and stderr; more Popen arguments as given)."""
    args = [sys.executable, "-c", PAUSING, root, point, action]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("then", ["forwarded", "cancelled"])
def test_a_forwarder_paused_past_its_claim_never_delivers_a_dead_letter_twice(root: str, then: str) -> None:
    """A forwarder stops between its claim and its append for longer than the claim lasts. Meanwhile another process
    either forwards the dead letter itself or, the destination being disabled, cancels the claim and a dead-letter
    receiver completes the message. Then the first forwarder resumes: it must append no second copy."""
    _dead_letter_forwarding_pair(root)
    child = pausing(root, "_deliver", "dead-letter")
    try:
        assert child.stdout is not None and child.stdout.readline() == "paused\n"  # after its claim, before its append
        time.sleep(2.1)  # the claim lapses while its forwarder is stopped
        with Namespace(root) as ns:
            if then == "cancelled":
                ns.update_queue(ns.get_queue("dst"), status="Disabled")
            ns.forward_pending_messages()
            if then == "cancelled":
                with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
                    (m,) = r.receive_messages(max_message_count=10, max_wait_time=5)
                    r.complete_message(m)
                ns.update_queue(ns.get_queue("dst"), status="Active")
    finally:
        out = resume(child)
    assert out == "resumed\n"
    with Namespace(root) as ns:
        main, dead = everywhere_of(ns, ("src", "dst"))
        expected = ["s0", "s1", "s2"] if then == "forwarded" else ["s0", "s1"]
        assert main == Counter(expected) and dead == Counter()


def test_a_message_a_concurrent_forwarder_expired_while_another_delivered_it_is_not_also_a_dead_letter(
    root: str,
) -> None:
    """Forwarder A reads m1 live and stops before its append; m1 expires, and forwarder B dead-letters it (expiry
    dead-letters on this queue); A resumes and appends m1. Before, m1 ended both forwarded and dead-lettered."""
    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src", enable_partitioning=False, dead_lettering_on_message_expiration=True)
    child = pausing(root, "_deliver", "go-forward", stdin=subprocess.PIPE)  # A starts before m1's time to live does
    try:
        assert child.stdout is not None and child.stdin is not None and child.stdout.readline() == "ready\n"
        with Namespace(root) as ns, ns.get_queue_sender("src") as s:
            # live until A has read it, after a process that sets forward_to has run (6 s were too few on a loaded machine)
            s.send_messages(Message("m1", message_id="m1", time_to_live=timedelta(seconds=15)))
        expires = time.monotonic() + 15
        set_forward_to_leaving_messages_waiting(root, "src", "dst")  # m1 waits: forward_pending_messages forwards it
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "paused\n"  # A read m1 while it was live
        time.sleep(max(0.0, expires - time.monotonic()) + 0.2)
        with Namespace(root) as b:
            b.forward_pending_messages()  # B: m1 expired, so it is dead-lettered
            with b.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
                assert [m.message_id for m in peek_all(r)] == ["m1"]
    finally:
        out = resume(child)
    assert out == "resumed\n"
    with Namespace(root) as ns:
        main, dead = everywhere_of(ns, ("src", "dst"))
        assert (main, dead) == (Counter({"m1": 1}), Counter())


# A sender in another process: "warm" sends one message (its cached settings of src are fresh then), "go" sends
# three more to three partitions at once, by those cached settings.
STALE_SENDER = r"""
import sys
from sparkqueue import Message, Namespace

with Namespace(sys.argv[1]) as ns, ns.get_queue_sender("src") as sender:
    for line in sys.stdin:
        if line.strip() == "warm":
            sender.send_messages(Message("warm", message_id="warm", partition_key="k0"))
        else:
            sender.send_messages([Message(f"stale{i}", message_id=f"stale{i}", partition_key=f"k{i + 1}") for i in range(3)])
        print("done", flush=True)
"""


def test_messages_sent_by_settings_cached_before_forward_to_was_set_are_forwarded(root: str) -> None:
    """Another process sends right after forward_to is set, by its cached settings (up to 1 s old): its messages were
    stored unforwarded, and unreceivable (the queue forwards), until forward_pending_messages or maintenance ran.
    The update now forwards once every process's cache shows the route."""
    import threading

    with Namespace(root) as ns:
        ns.create_queue("dst")
        ns.create_queue("src")
    child = subprocess.Popen([sys.executable, "-c", STALE_SENDER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        with Namespace(root) as ns:
            child.stdin.write("warm\n")
            child.stdin.flush()
            assert child.stdout.readline() == "done\n"
            update = threading.Thread(target=lambda: ns.update_queue(ns.get_queue("src"), forward_to="dst"))
            update.start()
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "done\n"
            update.join(60)
            assert not update.is_alive()
            main, _ = everywhere_of(ns, ("src", "dst"))
            assert main == Counter({"warm": 1, "stale0": 1, "stale1": 1, "stale2": 1})
            assert ns.get_queue_runtime_properties("src").total_message_count == 0
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0


def test_a_claim_cancelled_while_its_forwarder_was_paused_leaves_the_dead_letter_receivable(root: str) -> None:
    """Forwarder A claims s2 and stops before its append; the claim lapses and, dst being disabled, B records the claim
    as cancelled at dst and stops before releasing s2; A resumes: its append is skipped. Before, A then removed s2 as
    if its copy had gone out, and B's release found nothing to release: s2 was lost."""
    _dead_letter_forwarding_pair(root)
    a = pausing(root, "_deliver", "dead-letter")
    b: subprocess.Popen[str] | None = None
    try:
        assert a.stdout is not None and a.stdout.readline() == "paused\n"  # after its claim, before its append
        time.sleep(2.1)  # the claim lapses
        with Namespace(root) as ns:
            ns.update_queue(ns.get_queue("dst"), status="Disabled")
        b = pausing(root, "_record_cancel", "forward")
        assert b.stdout is not None and b.stdout.readline() == "paused\n"  # the claim recorded as cancelled
        assert resume(a) == "resumed\n"
    finally:
        a.send_signal(signal.SIGCONT)
        if b is not None:
            assert resume(b).endswith("resumed\n")
    with Namespace(root) as ns:
        ns.update_queue(ns.get_queue("dst"), status="Active")
        main, dead = everywhere_of(ns, ("src", "dst"))
        assert (main, dead) == (Counter({"s0": 1, "s1": 1}), Counter({"s2": 1}))
        with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
            assert [m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=5)] == ["s2"]


# A child: send 3-message batches to unpartitioned "A" (each send forwards by this process's cached route) until
# the stop file appears; acknowledged ids go to the ack file as in CHILD.
ROUTE_SENDER = r"""
import os, sys
from sparkqueue import Message, Namespace

root, ack_path, tag, stop = sys.argv[1:5]
fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
with Namespace(root) as ns, ns.get_queue_sender("A") as sender:
    os.write(fd, b"ready\n")
    b = 0
    while not os.path.exists(stop):
        msgs = [Message(f"{tag}.{b}.{i}", message_id=f"{tag}.{b}.{i}") for i in range(3)]
        sender.send_messages(msgs)
        os.write(fd, (" ".join(m.message_id for m in msgs) + "\n").encode())
        b += 1
"""

# A child: receive from "A" and complete, logging completed ids, until the stop file appears (refused while A forwards).
ROUTE_RECEIVER = r"""
import os, sys, time
from sparkqueue import Namespace
from sparkqueue.errors import InvalidOperationError

root, log_path, stop = sys.argv[1:4]
fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
with Namespace(root) as ns:
    while not os.path.exists(stop):
        try:
            with ns.get_queue_receiver("A") as r:
                while not os.path.exists(stop):
                    for m in r.receive_messages(max_message_count=20, max_wait_time=0.2):
                        r.complete_message(m)
                        os.write(fd, (m.message_id + "\n").encode())
        except InvalidOperationError:
            time.sleep(0.01)
"""


@pytest.mark.parametrize("change", ["changed", "removed"])
def test_forward_to_changed_under_traffic_moves_each_message_once(root: str, tmp_path: Path, change: str) -> None:
    """Two processes send to A (forwarding to B) while forward_to changes to C, or is removed while a third process
    receives from A. For a second, processes route by settings of either side of the change: two forwarders by
    different routes delivered one run to both B and C (6 of 9 trials), and a forwarder and a receiver took one
    message each (2 of 3). The route now rests across the change: every acknowledged message is in one place."""
    with Namespace(root) as ns:
        for q in ("B", "C"):
            ns.create_queue(q, enable_partitioning=False)
        ns.create_queue("A", enable_partitioning=False, forward_to="B")
    stop, received = tmp_path / "stop", tmp_path / "received"
    acks = [tmp_path / f"ack{c}" for c in range(2)]
    children = [
        subprocess.Popen([sys.executable, "-c", ROUTE_SENDER, root, str(ack), f"c{c}", str(stop)], stderr=subprocess.PIPE)
        for c, ack in enumerate(acks)
    ]
    if change == "removed":
        children.append(subprocess.Popen([sys.executable, "-c", ROUTE_RECEIVER, root, str(received), str(stop)]))
    try:
        for ack, child in zip(acks, children, strict=False):
            wait_ready(ack, child)
        time.sleep(1.0)
        with Namespace(root) as ns:
            ns.update_queue(ns.get_queue("A"), forward_to="C" if change == "changed" else None)
        time.sleep(0.5)
    finally:
        stop.touch()
        for child in children:
            assert child.wait(timeout=60) == 0
    with Namespace(root) as ns:
        ns.forward_pending_messages()
        main, dead = everywhere_of(ns, ("A", "B", "C"))
    main.update(received.read_text().split() if received.exists() else [])
    acked = {i for ack in acks for i in acked_ids(ack)}
    assert dead == Counter()
    doubled = {k: v for k, v in main.items() if v > 1}
    assert not doubled, f"{len(doubled)} message(s) in two places, e.g. {list(doubled.items())[:5]}"
    assert acked <= set(main), f"lost: {sorted(acked - set(main))[:5]}"


@pytest.mark.parametrize("receiver", ["plain", "named session", "next session with prefetch"])
def test_a_forwarder_slow_across_a_route_removal_and_a_receiver_never_both_take_a_message(root: str, receiver: str) -> None:
    """A forwarder read its run just before forward_to was removed and appends a moment later (here: stopped in its
    append for half a second). Receivers seeing the route removed took the message at once, so it was also in the old
    destination. Receives now wait out the route's rest as forwarders do: the message is in one place. Session
    receivers (an accept, its prefetch, a receive under the session lock) wait too: they took it twice before."""
    sessions = receiver != "plain"
    session_id = {"plain": None, "named session": "A", "next session with prefetch": NEXT_AVAILABLE_SESSION}[receiver]
    with Namespace(root) as ns:
        ns.create_queue("dst", enable_partitioning=False, requires_session=sessions)
        ns.create_queue("src", enable_partitioning=False, forward_to="dst", requires_session=sessions)
        injector = ns.broker.fault_injector("dst")
        injector.fail(0, ("write",))  # the send's own forward is put off: m1 waits in src
        ns.get_queue_sender("src").send_messages(Message("x", message_id="m1", session_id="A" if sessions else None))
        injector.heal()
    child = pausing(root, "_deliver", "go-forward", stdin=subprocess.PIPE)
    received: list[str] = []
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "paused\n"  # its run read, its append not made
        with Namespace(root) as ns:
            update = threading.Thread(target=lambda: ns.update_queue(ns.get_queue("src"), forward_to=None))
            update.start()
            # The forwarder goes on half a second into the rest, whatever the receivers below wait for (a session
            # accept sleeps out the rest): one stopped past the rest is a documented limit (docs/semantics.md §9).
            resumed: list[str] = []
            resumer = threading.Timer(0.5, lambda: resumed.append(resume(child)))
            resumer.start()
            until = time.monotonic() + 2.5
            while update.is_alive() or time.monotonic() < until:
                # A fresh client each time, as a receiver elsewhere starting now: its settings are the newest.
                options: dict[str, Any] = {"receive_mode": ReceiveMode.RECEIVE_AND_DELETE, "max_wait_time": 0.02}
                if sessions:
                    options |= {"session_id": session_id, "prefetch_count": 10 if session_id is NEXT_AVAILABLE_SESSION else 0}
                with (
                    Namespace(root) as other,
                    # refused while the catalog still says it forwards; no free session within the wait
                    contextlib.suppress(InvalidOperationError, OperationTimeoutError),
                    other.get_queue_receiver("src", **options) as r,
                ):
                    received += [m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=0.02)]
            update.join()
            resumer.join()
            assert resumed == ["resumed\n"]
    finally:
        if child.returncode is None:
            resume(child)
    with Namespace(root) as ns:
        main, dead = everywhere_of(ns, ("src", "dst"), session_id="A" if sessions else None)
    main.update(received)
    assert (main, dead) == (Counter({"m1": 1}), Counter())


def test_a_message_sent_while_a_dying_update_rested_the_route_reaches_the_end_of_its_chain(root: str) -> None:
    """The process changing forward_to dies during the route's rest, so its forward of what waits never runs, and a
    message sent meanwhile stays in the source. Its new destination forwards on, so only the chain's far end has
    receivers: they now forward what any entity upstream owes them."""
    with Namespace(root) as ns:
        for name, to in (("end", None), ("mid", "end"), ("old", None), ("src", "old")):
            ns.create_queue(name, enable_partitioning=False, **({"forward_to": to} if to else {}))
    set_forward_to_leaving_messages_waiting(root, "src", "mid")
    with Namespace(root) as ns:
        ns.get_queue_sender("src").send_messages(Message("x", message_id="m1"))  # during the rest: not forwarded
        assert ns.get_queue_runtime_properties("src").active_message_count == 1
    time.sleep(1.6)  # the rest is over
    with Namespace(root) as ns, ns.get_queue_receiver("end") as r:
        assert [m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=5)] == ["m1"]
        assert ns.get_queue_runtime_properties("src").active_message_count == 0
