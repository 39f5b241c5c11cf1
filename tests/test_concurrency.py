"""Several real processes ("spawn") on one namespace: competing receivers, concurrent senders,
concurrent duplicate sends, racing creators, and a sender/receiver killed with SIGKILL
(docs/semantics.md §1, §2, §4, §5, §10)."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import procs
import pyarrow.parquet as pq
import pytest
from procs import drain_all, key_for_partition, peek_all

from sparkqueue import Message, Namespace, SqlRuleFilter
from sparkqueue.errors import MessageLockLostError
from sparkqueue.model import limits
from sparkqueue.model.addresses import Address

CTX = mp.get_context("spawn")
CHILD_TIMEOUT_S = 120.0


def _run(target: Callable[..., None], n: int, args: Callable[[int, Any, Any], tuple[Any, ...]]) -> list[Any]:
    """Start n child processes running target(*args(i, barrier, results)) and return what each put on `results`."""
    return _run_mixed([(target, args)] * n)


def _run_mixed(specs: list[tuple[Callable[..., None], Callable[[int, Any, Any], tuple[Any, ...]]]]) -> list[Any]:
    """Start one child per (target, args) spec, all released by one barrier; return what each put on `results`."""
    barrier = CTX.Barrier(len(specs))
    results = CTX.Queue()
    children = [CTX.Process(target=t, args=a(i, barrier, results), daemon=True) for i, (t, a) in enumerate(specs)]
    for c in children:
        c.start()
    out: list[Any] = []
    give_up = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while len(out) < len(children):
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                crashed = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                assert not crashed, f"a child process failed with exit code(s) {crashed}"
                assert time.monotonic() < give_up, "child processes did not report in time"
        for c in children:
            c.join(timeout=30)
            assert c.exitcode == 0
    finally:
        for c in children:
            if c.is_alive():
                c.kill()
    return out


def _send(root: str, msgs: list[Message], queue_name: str = "q") -> list[int]:
    with Namespace(root) as ns, ns.get_queue_sender(queue_name) as s:
        seqs: list[int] = []
        for start in range(0, len(msgs), 50):
            seqs += s.send_messages(msgs[start : start + 50])
        return seqs


# ---- competing receivers ---------------------------------------------------------------------


def _race_receivers(root: str, ids: list[str], workers: int) -> None:
    """Run `workers` receiver processes until every id is completed; check each was delivered and completed once."""
    done = CTX.Value("i", 0)
    reports = _run(procs.receive_and_complete, workers, lambda i, b, r: (root, "q", b, done, len(ids), r, i))
    delivered = [d for _, dl, _, _ in reports for d in dl]
    completed = [c for _, _, cl, _ in reports for c in cl]
    lost = sum(n for *_, n in reports)
    dup_deliveries = [mid for mid, n in Counter(mid for mid, _ in delivered).items() if n > 1]
    assert dup_deliveries == [], f"messages delivered twice under 60 s locks: {dup_deliveries[:10]}"
    assert {dc for _, dc in delivered} == {0}
    assert lost == 0
    assert len(completed) == len(ids)
    assert set(completed) == set(ids)
    active_workers = sum(1 for _, _, cl, _ in reports if cl)
    assert active_workers >= 2, "the race needs at least two receivers that got messages"
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_competing_receivers_complete_each_message_once(root: str) -> None:
    """4 receiver processes over 300 messages in all partitions: every message is delivered and completed exactly once."""
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=60))
    ids = [f"m{i}" for i in range(300)]
    msgs = [Message(i, message_id=i) for i in ids]
    with Namespace(root) as ns, ns.get_queue_sender("q") as s:
        for start in range(0, 300, 10):  # unkeyed batches spread round-robin over the partitions
            s.send_messages(msgs[start : start + 10])
        assert sum(1 for p in ns.get_queue_runtime_properties("q").partitions if p.active_message_count) == 16
    _race_receivers(root, ids, workers=4)


def test_competing_receivers_on_one_partition(root: str) -> None:
    """4 receiver processes fighting over one partition's files: every message is delivered and completed exactly once."""
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=60))
    key = key_for_partition(13, "hot")
    ids = [f"h{i}" for i in range(300)]
    seqs = _send(root, [Message(i, message_id=i, partition_key=key) for i in ids])
    assert {s >> 48 for s in seqs} == {13}
    _race_receivers(root, ids, workers=4)


def test_senders_and_receivers_at_once(root: str) -> None:
    """2 senders and 3 receivers running together: every message sent is delivered and completed exactly once."""
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=60))
    per_sender = 80
    done = CTX.Value("i", 0)
    hot = key_for_partition(2, "mixed")
    specs: list[tuple[Callable[..., None], Callable[[int, Any, Any], tuple[Any, ...]]]] = [
        (procs.send_sequence, lambda i, b, r: (root, "q", b, r, i, per_sender, hot, 4)),
        (procs.send_sequence, lambda i, b, r: (root, "q", b, r, i, per_sender, None, 4)),
    ]
    specs += [(procs.receive_and_complete, lambda i, b, r: (root, "q", b, done, 2 * per_sender, r, i))] * 3
    reports = _run_mixed(specs)
    sent = {mid for rep in reports if len(rep) == 3 for mid in rep[1]}
    receiver_reports = [rep for rep in reports if len(rep) == 4]
    delivered = [mid for _, dl, _, _ in receiver_reports for mid, _ in dl]
    completed = [mid for _, _, cl, _ in receiver_reports for mid in cl]
    assert len(sent) == 2 * per_sender
    assert len(delivered) == len(set(delivered)), "a message was delivered twice under a 60 s lock"
    assert sorted(completed) == sorted(sent)
    assert sum(n for *_, n in receiver_reports) == 0


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_short_locks_expiring_under_racing_receivers_hold_one_lock_each(root: str) -> None:
    """4 processes, 1 s locks, completing, abandoning or letting locks lapse: at most one valid lock per message at any moment.

    Checked from the locks' own times (a lock taken at `locked_until - lock_duration`): no message
    is locked again before its previous lock ended (expiry, or the abandon that released it), none
    after a successful complete; each delivery's delivery_count is the number before it; a complete
    past the lock's expiry is refused; no message is delivered more than max_delivery_count times,
    and every message ends completed once or dead-lettered with MaxDeliveryCountExceeded.
    """
    lock_s, max_deliveries = 1.0, 3
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=lock_s), max_delivery_count=max_deliveries)
    ids = [f"x{i}" for i in range(120)]
    _send(root, [Message(i, message_id=i) for i in ids])
    reports = _run(procs.settle_abandon_or_lapse, 4, lambda i, b, r: (root, "q", b, r, i, 1000 + i, 3 * lock_s))
    by_id: dict[str, list[tuple[int, float, str, float]]] = defaultdict(list)
    for _, deliveries in reports:
        for mid, count, until, outcome, start in deliveries:
            by_id[mid].append((count, until, outcome, start))
    assert sum(1 for _, d in reports if d) >= 2, "the race needs at least two receivers that got messages"
    outcomes = Counter(o for ds in by_id.values() for _, _, o, _ in ds)
    assert outcomes["lost"] and outcomes["abandoned"] and outcomes["completed"], outcomes  # every path was taken
    assert outcomes["stale_completed"] == 0, "a complete after the lock expired was accepted"
    for mid, ds in by_id.items():
        ds.sort(key=lambda d: d[1])
        assert [c for c, *_ in ds] == list(range(len(ds))), f"{mid}: delivery counts {[c for c, *_ in ds]}"
        assert len(ds) <= max_deliveries, f"{mid} delivered {len(ds)} times"
        for (_, until, outcome, start), (_, next_until, _, _) in itertools.pairwise(ds):
            assert outcome != "completed", f"{mid} delivered again after it was completed"
            ended = start if outcome == "abandoned" else until
            early = ended - (next_until - lock_s)
            assert early <= 0.001, f"{mid} locked again {early:.3f} s before its previous lock ended"
    completed = sorted(mid for mid, ds in by_id.items() if any(o == "completed" for _, _, o, _ in ds))
    with Namespace(root) as ns:
        with ns.get_queue_receiver("q", sub_queue="deadletter") as dlq:
            dead = drain_all(dlq)
        assert {m.dead_letter_reason for m in dead} <= {"MaxDeliveryCountExceeded"}
        assert all(len(by_id[m.message_id]) == max_deliveries for m in dead)
        assert sorted(completed + [m.message_id for m in dead]) == sorted(ids), "a message was lost or kept twice"
        assert ns.get_queue_runtime_properties("q").active_message_count == 0


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_transactions_racing_on_one_partition_apply_once_each(root: str) -> None:
    """3 processes each completing tasks in transactions that send 2 results, all on one partition.

    Their commits conflict and retry: every task is completed by exactly one committed transaction,
    every committed transaction's results exist exactly once, and nothing else does.
    """
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=60))
    tasks = [f"task{i}" for i in range(45)]
    _send(root, [Message(t, message_id=t, partition_key="k") for t in tasks])
    done = CTX.Value("i", 0)
    reports = _run(procs.transactional_worker, 3, lambda i, b, r: (root, "q", b, r, i, done, len(tasks)))
    committed = [t for _, c, _, _ in reports for t in c]
    finished = [m for _, _, f, _ in reports for m in f]
    assert sorted(committed) == sorted(tasks), "a task was committed twice, or never"
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        left = [m.message_id for m in drain_all(r)]
    results = Counter(finished + left)
    assert results == Counter(f"res-{t}-{j}" for t in tasks for j in range(2)), "results of a transaction applied twice or lost"
    assert sum(1 for _, c, _, _ in reports if c) >= 2, "the race needs at least two workers that committed"


# ---- concurrent senders ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 5])
def test_concurrent_senders_to_one_partition(root: str, batch: int) -> None:
    """3 sender processes on one partition: nothing lost, sequence numbers unique and strictly increasing in enqueue order.

    Enqueue order across processes is known where calls did not overlap: a send that returned
    before another began must hold the lower numbers.
    """
    with Namespace(root) as ns:
        ns.create_queue("q")
    key = key_for_partition(5, "shared")
    per_worker = 40
    reports = _run(procs.send_timed, 3, lambda i, b, r: (root, "q", b, r, i, per_worker, key, batch))
    sent: dict[str, int] = {}
    calls = [call for _, worker_calls in reports for call in worker_calls]
    for _, worker_calls in reports:
        seqs = [s for *_, call_seqs in worker_calls for s in call_seqs]
        assert len(seqs) == per_worker
        assert all(a < b for a, b in itertools.pairwise(seqs)), "a process's sends must get increasing numbers"
    for _, _, ids, seqs in calls:
        sent.update(zip(ids, seqs, strict=True))
    ordered = [(a, b) for a in calls for b in calls if a[1] < b[0]]  # a returned before b began
    assert ordered, "some sends must have happened one after another"
    late = [(a[2], b[2]) for a, b in ordered if max(a[3]) >= min(b[3])]
    assert late == [], f"a later send got lower sequence numbers than an earlier one: {late[:3]}"
    all_seqs = list(sent.values())
    assert len(set(all_seqs)) == len(all_seqs) == 3 * per_worker
    assert {s >> 48 for s in all_seqs} == {5}
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        stored = peek_all(r)
    assert {m.message_id: m.sequence_number for m in stored} == sent
    assert len(stored) == len(sent)
    # Stamped in the commit attempt that numbered them: racing senders used to store a later number with an earlier
    # enqueued_time_utc (stamped before a retry, or before another sender's commit that landed first).
    by_seq = sorted(stored, key=lambda m: m.sequence_number)
    backwards = [
        (a.sequence_number, b.sequence_number) for a, b in itertools.pairwise(by_seq) if b.enqueued_time_utc < a.enqueued_time_utc
    ]
    assert backwards == [], f"higher sequence numbers enqueued earlier: {backwards[:3]}"


def test_concurrent_unkeyed_senders_lose_nothing(root: str) -> None:
    """3 processes sending unkeyed batches at once: every message is stored once, sequence numbers are unique."""
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
    reports = _run(procs.send_sequence, 3, lambda i, b, r: (root, "q", b, r, i, 30, None, 3))
    sent = {mid: seq for _, ids, seqs in reports for mid, seq in zip(ids, seqs, strict=True)}
    assert len(sent) == 90
    assert len(set(sent.values())) == 90
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        stored = drain_all(r)
    assert sorted(m.message_id for m in stored) == sorted(sent)
    assert [m.sequence_number for m in stored] == sorted(m.sequence_number for m in stored)


def test_concurrent_duplicate_sends_store_one_copy(root: str) -> None:
    """3 processes sending the same message ids to a partitioned duplicate-detecting queue store exactly one copy of each.

    Two processes send the same batches in the same order, so each batch races in the same
    partitions at the same moment; the third sends them in reverse and meets the others midway.
    """
    with Namespace(root) as ns:
        ns.create_queue("q", requires_duplicate_detection=True)
    ids = [f"d{i}" for i in range(60)]

    def args(i: int, b: Any, r: Any) -> tuple[Any, ...]:
        return (root, "q", b, r, i, ids[::-1] if i == 2 else ids, 10)

    reports = _run(procs.send_ids, 3, args)
    assert sum(stored for _, stored in reports) == len(ids)
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        stored_msgs = peek_all(r)
        assert ns.get_queue_runtime_properties("q").total_message_count == len(ids)
    assert sorted(m.message_id for m in stored_msgs) == sorted(ids)


def test_concurrent_duplicate_sends_to_one_partition(root: str) -> None:
    """Duplicate sends racing on one partition (shared partition key) still store one copy of each id."""
    with Namespace(root) as ns:
        ns.create_queue("q", requires_duplicate_detection=True, enable_partitioning=False)
    ids = [f"s{i}" for i in range(40)]
    reports = _run(procs.send_ids, 3, lambda i, b, r: (root, "q", b, r, i, ids, 4))
    assert sum(stored for _, stored in reports) == len(ids)
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        got = drain_all(r)
    assert sorted(m.message_id for m in got) == sorted(ids)


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_concurrent_duplicate_sends_to_a_topic_copy_once_per_subscription(root: str) -> None:
    """3 processes sending the same ids to a duplicate-detecting topic: each subscription its rules select gets one copy."""
    with Namespace(root) as ns:
        ns.create_topic("t", requires_duplicate_detection=True)
        ns.create_subscription("t", "all")
        ns.create_subscription("t", "tens")
        ns.delete_rule("t", "tens", "$Default")
        ns.create_rule("t", "tens", "tens", filter=SqlRuleFilter("sys.MessageId LIKE '%0'"))
    ids = [f"t{i}" for i in range(60)]
    _run(procs.send_ids, 3, lambda i, b, r: (root, "t", b, r, i, ids[::-1] if i == 2 else ids, 10, True))
    with Namespace(root) as ns:
        for sub, want in (("all", ids), ("tens", [i for i in ids if i.endswith("0")])):
            with ns.get_subscription_receiver("t", sub) as r:
                got = Counter(m.message_id for m in drain_all(r))
            assert got == Counter(want), f"subscription {sub}: {got - Counter(want)} extra, {Counter(want) - got} missing"


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_receive_and_delete_racing_processes_take_each_message_once(root: str) -> None:
    """4 processes receiving in RECEIVE_AND_DELETE mode: every message goes to exactly one of them, and none is lost."""
    with Namespace(root) as ns:
        ns.create_queue("q")
    ids = [f"r{i}" for i in range(300)]
    _send(root, [Message(i, message_id=i) for i in ids])
    reports = _run(procs.receive_and_delete, 4, lambda i, b, r: (root, "q", b, r, i, 1.0))
    taken = Counter(mid for _, got in reports for mid in got)
    assert [mid for mid, n in taken.items() if n > 1] == [], "a message was given to two receivers"
    assert sorted(taken) == sorted(ids)
    assert sum(1 for _, got in reports if got) >= 2, "the race needs at least two receivers that got messages"
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_competing_receivers_on_a_subscription_and_concurrent_topic_senders(root: str) -> None:
    """2 topic senders and 3 receivers of one subscription at once: each copy is delivered and completed once; the
    other subscription gets every message once too."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "work", lock_duration=timedelta(seconds=60))
        ns.create_subscription("t", "audit")
    halves = [[f"a{i}" for i in range(90)], [f"b{i}" for i in range(90)]]
    done = CTX.Value("i", 0)
    specs: list[tuple[Callable[..., None], Callable[[int, Any, Any], tuple[Any, ...]]]] = [
        (procs.send_ids, lambda i, b, r: (root, "t", b, r, i, halves[i], 5, True)),
        (procs.send_ids, lambda i, b, r: (root, "t", b, r, i, halves[i], 5, True)),
    ]
    specs += [(procs.receive_and_complete, lambda i, b, r: (root, "t/work", b, done, 180, r, i))] * 3
    reports = [rep for rep in _run_mixed(specs) if len(rep) == 4]
    delivered = [mid for _, dl, _, _ in reports for mid, _ in dl]
    completed = [mid for _, _, cl, _ in reports for mid in cl]
    assert len(delivered) == len(set(delivered)), "a copy was delivered twice under a 60 s lock"
    assert sorted(completed) == sorted(halves[0] + halves[1])
    assert sum(n for *_, n in reports) == 0
    with Namespace(root) as ns, ns.get_subscription_receiver("t", "audit") as r:
        assert sorted(m.message_id for m in drain_all(r)) == sorted(halves[0] + halves[1])


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1)
def test_a_receiver_working_through_a_senders_sigkill_completes_everything_once(root: str, tmp_path: Path) -> None:
    """A receiver process keeps completing while a sender (which also locks) is SIGKILLed beside it.

    Every accepted message is completed exactly once, the dead sender's locked messages come back
    after their locks lapse, and no batch is stored in part.
    """
    lock, batch = timedelta(seconds=3), 4
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=lock)
    sent_path, locked_path = tmp_path / "sent.txt", tmp_path / "locked.txt"
    results, barrier = CTX.Queue(), CTX.Barrier(1)  # kept referenced until the children have started
    sender = CTX.Process(
        target=procs.send_and_lock_until_killed, args=(root, "q", str(sent_path), str(locked_path), batch), daemon=True
    )
    survivor = CTX.Process(
        target=procs.receive_until_idle,
        args=(root, "q", barrier, results, 0, lock.total_seconds() + 2, False),
        daemon=True,
    )
    sender.start()
    survivor.start()
    try:
        give_up = time.monotonic() + CHILD_TIMEOUT_S
        while len(_lines(sent_path)) < 20 * batch:
            assert sender.is_alive() and survivor.is_alive(), "a child died early"
            assert time.monotonic() < give_up, "the sender made no progress"
            time.sleep(0.02)
        time.sleep(random.uniform(0, 0.1))
        os.kill(sender.pid, signal.SIGKILL)  # type: ignore[arg-type]
        sender.join(timeout=30)
        _, completed = results.get(timeout=CHILD_TIMEOUT_S)
        survivor.join(timeout=30)
    finally:
        for child in (sender, survivor):
            if child.is_alive():
                child.kill()
    assert (sender.exitcode, survivor.exitcode) == (-signal.SIGKILL, 0)
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        left = drain_all(r)  # none, unless the survivor's idle wait ended first on a very slow machine
        r.complete_messages(left)
        assert ns.get_queue_runtime_properties("q").total_message_count == 0
    taken = Counter(completed + [m.message_id for m in left])
    assert [mid for mid, n in taken.items() if n > 1] == [], "a message was completed twice"
    accepted, locked_by_sender = set(_lines(sent_path)), set(_lines(locked_path))
    assert accepted <= set(taken), f"accepted sends lost: {sorted(accepted - set(taken))[:10]}"
    assert locked_by_sender <= set(taken), "a message the dead sender held never came back"
    batches: dict[str, set[str]] = defaultdict(set)
    for mid in taken:
        name, _, k = mid.partition("-")
        batches[name].add(k)
    assert all(len(ks) == batch for ks in batches.values()), "a batch was stored in part"


# ---- racing creators ---------------------------------------------------------------------------


def test_racing_creators_one_wins(root: str) -> None:
    """Processes creating the same queue at once: exactly one succeeds, the others get EntityAlreadyExistsError."""
    Namespace(root).close()  # the catalog exists before the race
    reports = _run(procs.create_queue, 3, lambda i, b, r: (root, "raced", b, r, i))
    outcomes = Counter(outcome for _, outcome in reports)
    assert outcomes == Counter({"created": 1, "exists": 2})
    (winner,) = [w for w, outcome in reports if outcome == "created"]
    with Namespace(root) as ns:
        assert [q.name for q in ns.list_queues()] == ["raced"]
        assert ns.get_queue("raced").max_delivery_count == winner + 1
        with ns.get_queue_sender("raced") as s:
            s.send_messages(Message("works"))
        with ns.get_queue_receiver("raced") as r:
            assert [str(m) for m in drain_all(r)] == ["works"]


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1); the default run keeps under 5 minutes
def test_racing_queue_and_topic_of_one_name_one_wins(root: str) -> None:
    """Processes creating queues and topics named alike but for case, at once: one entity wins, the others are refused."""
    Namespace(root).close()
    names = ["Orders", "orders", "ORDERS", "orders"]
    reports = _run(procs.create_queue, 4, lambda i, b, r: (root, names[i], b, r, i, i % 2 == 1))
    assert Counter(outcome for _, outcome in reports) == Counter({"created": 1, "exists": 3})
    with Namespace(root) as ns:
        assert len(ns.list_queues()) + len(ns.list_topics()) == 1


def test_racing_rules_named_alike_but_for_case_one_wins(root: str) -> None:
    """Rule names ignore case, as in Service Bus: of four processes creating "Audit" in various cases, one succeeds."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    names = ["Audit", "audit", "AUDIT", "aUdIt"]
    reports = _run(procs.create_rule, 4, lambda i, b, r: (root, names[i], b, r, i))
    assert Counter(outcome for _, outcome in reports) == Counter({"created": 1, "exists": 3})
    with Namespace(root) as ns:
        assert sorted(r.name.lower() for r in ns.list_rules("t", "s")) == ["$default", "audit"]


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1): it writes about 1.3 GB
def test_racing_senders_never_take_a_partition_past_its_size(root: str) -> None:
    """Four processes each sending 100 MB into a 1,024 MB partition with room for one: exactly one is stored."""
    big = 100 * 1024 * 1024 - 1024  # just under the premium message limit
    with Namespace(root, tier="premium") as ns:
        ns.create_queue("q", max_size_in_megabytes=1024)
        with ns.get_queue_sender("q") as s:
            for i in range(9):  # about 900 MB
                s.send_messages(Message(os.urandom(big), message_id=f"fill-{i}"))
    reports = _run(procs.send_big, 4, lambda i, b, r: (root, "q", b, r, i, big))
    assert Counter(outcome for _, outcome in reports) == Counter({"sent": 1, "over quota": 3})
    with Namespace(root, tier="premium") as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert rp.active_message_count == 10
        assert rp.size_in_bytes <= 1024 * 1024 * 1024


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1): 98 queues to create first
def test_racing_creators_never_pass_the_partitioned_entity_quota(root: str) -> None:
    """Four processes creating partitioned queues when two more fit: exactly two succeed (the quota is checked in the commit)."""
    with Namespace(root) as ns:
        for i in range(limits.MAX_PARTITIONED_ENTITIES - 2):
            ns.create_queue(f"q{i}")
    reports = _run(procs.create_queue, 4, lambda i, b, r: (root, f"raced{i}", b, r, i))
    assert Counter(outcome for _, outcome in reports) == Counter({"created": 2, "over quota": 2})
    with Namespace(root) as ns:
        assert len(ns.list_queues()) == limits.MAX_PARTITIONED_ENTITIES


@pytest.mark.slow  # CI runs it (SPARKQUEUE_SLOW=1): two 3-second races
@pytest.mark.parametrize(
    ("parent", "maker", "first"),
    [("topic", "sub-maker", None), ("subscription", "rule-maker", "topic")],
)
def test_a_child_created_while_its_parent_is_deleted_never_outlives_it(
    root: str, parent: str, maker: str, first: str | None
) -> None:
    """A subscription (or rule) created while its topic (subscription) is deleted goes with it, never left behind.

    One process creates and deletes the parent in a loop, another creates the child in a loop.
    The parent's check and the child's insert are one catalog commit, and a delete removes the
    children it finds in its own commit, so no child row is ever left without its parent, where
    it would reappear under a later parent of the same name.
    """
    with Namespace(root) as ns:
        if first == "topic":
            ns.create_topic("t")
    churn = [(procs.churn_catalog, lambda i, b, r: (root, parent, b, r, i, 3.0))]
    reports = _run_mixed(churn + [(procs.churn_catalog, lambda i, b, r: (root, maker, b, r, i, 3.0))] * 2)
    assert sum(n for _, n in reports) > 0, "the race never let a child land: it tested nothing"
    with Namespace(root) as ns:
        versions = _catalog_versions(ns.broker.catalog.uri)
        assert len(versions) > 20
        orphaned = {v: o for v, keys in versions.items() if (o := [k for k in keys if not _parent_present(k, keys)])}
        assert orphaned == {}, "a catalog version held a child without its parent (a later parent would inherit it)"
        keys = versions[max(versions)]
        if "topic:t" not in keys:  # a new parent of the same name starts with nothing of the old one's
            ns.create_topic("t")
            assert ns.list_subscriptions("t") == []
        if "subscription:t/s" not in keys:
            ns.create_subscription("t", "s")
            assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def _catalog_versions(uri: str) -> dict[int, list[str]]:
    """The catalog's keys at every version its log still holds (each version's one file, read back)."""
    out: dict[int, list[str]] = {}
    for entry in sorted(Path(uri, "_delta_log").glob("*.json")):
        adds = [a["add"]["path"] for a in map(json.loads, entry.read_text().splitlines()) if "add" in a]
        if adds:  # every catalog change writes the whole catalog as one file
            out[int(entry.stem)] = pq.read_table(Path(uri, adds[0]), columns=["name"]).column("name").to_pylist()
    return out


def _parent_present(key: str, keys: list[str]) -> bool:
    """Whether a subscription's topic (a rule's subscription) has a catalog row among `keys`; True for other keys."""
    if not key.startswith(("subscription:", "rule:")):
        return True
    kind = "topic:" if key.startswith("subscription:") else "subscription:"
    child = Address.parse(key)
    return any(k.startswith(kind) and child.is_child_of(Address.parse(k)) for k in keys)


def test_racing_creators_on_a_new_namespace(root: str) -> None:
    """Processes opening a namespace that does not exist yet and creating one queue: one wins, the others are told it exists."""
    reports = _run(procs.create_queue, 2, lambda i, b, r: (root, "first", b, r, i))
    assert sorted(outcome for _, outcome in reports) == ["created", "exists"]
    with Namespace(root) as ns:
        assert [q.name for q in ns.list_queues()] == ["first"]


# ---- a process killed mid-way ----------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    """Complete lines of a file written by a child (a torn last line is ignored)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return text.split("\n")[:-1]


@pytest.mark.parametrize("extra_delay", [0.0, 0.15])
def test_killed_process_loses_nothing_and_its_locks_lapse(root: str, tmp_path: Path, extra_delay: float) -> None:
    """After SIGKILL mid-loop: every accepted send is stored, no batch is half-applied, and its locks lapse."""
    lock = timedelta(seconds=3)
    batch = 4
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=lock)
    sent_path, locked_path = tmp_path / "sent.txt", tmp_path / "locked.txt"
    child = CTX.Process(
        target=procs.send_and_lock_until_killed, args=(root, "q", str(sent_path), str(locked_path), batch), daemon=True
    )
    child.start()
    try:
        give_up = time.monotonic() + CHILD_TIMEOUT_S
        while len(_lines(sent_path)) < 10 * batch:
            assert child.is_alive(), f"the child died early with exit code {child.exitcode}"
            assert time.monotonic() < give_up, "the child made no progress"
            time.sleep(0.02)
        time.sleep(extra_delay + random.uniform(0, 0.05))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(timeout=30)
        killed_at = time.monotonic()
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    accepted = set(_lines(sent_path))
    locked_by_child = set(_lines(locked_path))
    assert accepted and locked_by_child

    # Wait for every lock the child held to lapse, then another receiver must get everything.
    time.sleep(max(0.0, lock.total_seconds() + 0.3 - (time.monotonic() - killed_at)))
    delivery_counts: dict[str, int] = {}
    deliveries = 0
    lost_locks = 0
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        while got := r.receive_messages(max_message_count=20, max_wait_time=0.5):
            deliveries += len(got)
            for m in got:
                delivery_counts[m.message_id] = max(m.delivery_count, delivery_counts.get(m.message_id, 0))
            try:
                r.complete_messages(got)
            except MessageLockLostError:
                lost_locks += 1  # only on a badly overloaded machine: those messages come back and are completed later
        assert ns.get_queue_runtime_properties("q").total_message_count == 0
    ids = set(delivery_counts)
    if lost_locks == 0:
        assert deliveries == len(ids), "a message was delivered twice"
    assert accepted <= ids, f"accepted sends lost: {sorted(accepted - ids)[:10]}"
    batches: dict[str, set[str]] = defaultdict(set)
    for mid in ids:
        name, _, k = mid.partition("-")
        assert name.startswith("b") and k.isdigit(), f"unexpected message {mid!r}"
        batches[name].add(k)
    assert all(len(ks) == batch for ks in batches.values()), "a batch was stored in part"
    assert locked_by_child <= ids
    assert all(delivery_counts[mid] >= 1 for mid in locked_by_child), "the dead child's deliveries were not counted"


def test_sends_racing_a_queue_deleted_and_made_again_by_another_process_are_never_acknowledged_and_lost(root: str) -> None:
    """A send that starts after the queue was made again lands in the new queue; none is acknowledged into the old one.

    Sends racing the delete itself may fail with EntityNotFoundError; a sender whose cached table was
    deleted looks the queue up again and sends once more.

    Before, a sender's cached table took the commit (put-if-absent made the deleted table's
    directories again): the send was acknowledged and the message was in no queue.
    """
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
    out = dict(
        _run_mixed(
            [
                (procs.send_while_recreated, lambda i, b, r: (root, "q", b, r, i, 12.0)),  # past the cycles, also when slow
                (procs.recreate_queue, lambda i, b, r: (root, "q", b, r, i, 4, 1.2)),
            ]
        )
    )
    calls, windows = out[0], out[1]
    assert {outcome for _, _, outcome in calls} <= {"ok", "EntityNotFoundError"}
    checked = 0
    for created, peeked, held in windows:
        after = [(mid, outcome) for began, mid, outcome in calls if created < began < peeked - 0.2]
        assert {outcome for _, outcome in after} <= {"ok"}, "a send that began after the queue was made again failed"
        lost = sorted({mid for mid, _ in after} - set(held))
        assert lost == [], f"acknowledged after the queue was made again, not in it: {lost[:5]}"
        checked += len(after)
    assert checked > 20  # the sender kept going through the cycles
    with Namespace(root) as ns:
        assert ns.check() == []
