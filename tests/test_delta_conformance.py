"""Delta conformance: after random interleavings of every kind of write from several processes, an
independent reader (delta-rs, fresh from the log) sees exactly the table sparkqueue's snapshot sees.

Processes send, receive, complete, abandon, dead-letter, defer, run maintenance (compaction,
checkpoints, log trimming, vacuum) at random against one queue, on a local disk and on Azurite.
Afterwards delta-rs must list the same live files, the same `txn` fences and the same rows as a
fresh sparkqueue snapshot, and the rows must be what the API reports.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pytest
from azurite import Store
from deltalake import DeltaTable

from sparkqueue import Message, Namespace
from sparkqueue.errors import MessageLockLostError
from sparkqueue.storage.index import FileIndex
from sparkqueue.storage.log import DeltaLog

CTX = mp.get_context("spawn")
STEPS = 60


def random_worker(root: str, seed: int, barrier: Any, results: Any) -> None:
    """Perform STEPS random operations on queue "q"; report how many messages this worker sent."""
    rng = random.Random(seed)
    sent = 0
    with Namespace(root) as ns, ns.get_queue_sender("q") as s, ns.get_queue_receiver("q", max_wait_time=0.05) as r:
        barrier.wait(timeout=60)
        for step in range(STEPS):
            op = rng.choice(["send", "send", "keyed", "settle", "settle", "maintain" if seed == 0 else "settle"])
            if op == "send":
                n = rng.randint(1, 30)
                s.send_messages([Message(f"{seed}-{step}-{i}", message_id=f"{seed}-{step}-{i}") for i in range(n)])
                sent += n
            elif op == "keyed":
                s.send_messages(
                    [Message(f"{seed}-{step}-k", message_id=f"{seed}-{step}-k", partition_key=f"k{rng.randint(0, 3)}")]
                )
                sent += 1
            elif op == "settle":
                for m in r.receive_messages(rng.randint(1, 20)):
                    action = rng.choice(["complete", "complete", "abandon", "dead_letter", "defer", "leave"])
                    try:
                        if action == "complete":
                            r.complete_message(m)
                        elif action == "abandon":
                            r.abandon_message(m)
                        elif action == "dead_letter":
                            r.dead_letter_message(m, reason="conformance")
                        elif action == "defer":
                            r.defer_message(m)
                    except MessageLockLostError:
                        pass
            else:
                ns.run_maintenance(vacuum_retention=timedelta(0))
    results.put((seed, sent))


# The Azurite run takes ~40 s (every step is several HTTP calls): it runs with the slow tests (CI), the local one always.
@pytest.mark.parametrize("store", ["local", pytest.param("azure", marks=pytest.mark.slow)], indirect=True)
def test_delta_rs_reads_exactly_what_sparkqueue_wrote_after_random_concurrent_work(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=5))
        uri = ns.table_uri(ns.broker.entry("queue", "q").table_path)
    barrier, results = CTX.Barrier(3), CTX.Queue()
    procs = [CTX.Process(target=random_worker, args=(store.root, seed, barrier, results)) for seed in range(3)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    with store.open() as ns:
        table = ns.broker.entity("queue", "q").table
        ours = DeltaLog(table.store, FileIndex).load()
        theirs = DeltaTable(uri, storage_options=store.storage_options)
        assert theirs.version() == ours.version
        assert ours.version > 100  # the run crossed a checkpoint (every 100 versions) and its log trimming
        adds = pa.table(theirs.get_add_actions(flatten=True))
        assert sorted(adds.column("path").to_pylist()) == sorted(f.path for f in ours.files)
        for app, version in ours.txns.items():
            assert theirs.transaction_version(app) == version
        rows = theirs.to_pyarrow_table(columns=["sequence_number", "message_id", "state", "sub_queue"])
        our_rows = pa.concat_tables(
            [table.data.read(f.path, ["sequence_number", "message_id", "state", "sub_queue"]) for f in ours.files]
        )
        assert sorted(rows.to_pylist(), key=lambda r: r["sequence_number"]) == sorted(
            our_rows.to_pylist(), key=lambda r: r["sequence_number"]
        )
        # The rows are what the API reports: live messages = sent - completed, none twice.
        seqs = rows.column("sequence_number").to_pylist()
        assert len(seqs) == len(set(seqs))
        live = [r for r in rows.to_pylist() if r["state"] != "completed"]
        rp = ns.get_queue_runtime_properties("q")
        assert rp.total_message_count == len(live)
        assert sum(n for _, n in reports) >= len(live)
