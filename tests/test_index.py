"""The file index (storage/index.py): live files per partition from add/remove actions, and pruning by statistics.

Every receive, settle and session accept prunes files with these statistics, so a wrong bound
here would skip a file that holds messages (they would never be delivered) or read every file.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sparkqueue.storage.index import FileIndex, FileInfo
from sparkqueue.storage.schema import ANY_SUBSCRIPTION, KIND_MESSAGE, KIND_SESSION, SUB_QUEUE_DEAD_LETTER, SUB_QUEUE_MAIN


def add_action(path: str, partition: int, lo_seq: int, hi_seq: int, **stats: Any) -> dict[str, Any]:
    """An `add` action as the engine writes it: partition value, size and JSON statistics."""
    lo = {"sequence_number": lo_seq, **{k[4:]: v for k, v in stats.items() if k.startswith("min_")}}
    hi = {"sequence_number": hi_seq, **{k[4:]: v for k, v in stats.items() if k.startswith("max_")}}
    nulls = {k[6:]: v for k, v in stats.items() if k.startswith("nulls_")}
    body = {"numRecords": hi_seq - lo_seq + 1, "minValues": lo, "maxValues": hi, "nullCount": nulls}
    return {"path": path, "partitionValues": {"partition_id": str(partition)}, "size": 100, "stats": json.dumps(body)}


def test_a_partition_lists_its_live_files_by_lowest_sequence_number() -> None:
    index = FileIndex()
    index.add(add_action("p=1/c.parquet", 1, 30, 39))
    index.add(add_action("p=1/a.parquet", 1, 10, 19))
    index.add(add_action("p=2/b.parquet", 2, 5, 9))
    assert [f.path for f in index.partition(1)] == ["p=1/a.parquet", "p=1/c.parquet"]
    index.add(add_action("p=1/b.parquet", 1, 20, 29))  # a new file invalidates the cached order
    assert [f.path for f in index.partition(1)] == ["p=1/a.parquet", "p=1/b.parquet", "p=1/c.parquet"]
    index.remove("p=1/a.parquet")
    assert [f.path for f in index.partition(1)] == ["p=1/b.parquet", "p=1/c.parquet"]
    assert "p=1/a.parquet" not in index and len(index) == 3
    index.remove("never-added.parquet")  # a remove of an unknown file changes nothing
    assert len(index) == 3
    assert sorted(a["path"] for a in index.actions()) == ["p=1/b.parquet", "p=1/c.parquet", "p=2/b.parquet"]


def test_a_copy_is_independent_of_the_original() -> None:
    index = FileIndex()
    index.add(add_action("a.parquet", 0, 1, 1))
    other = index.copy()
    other.add(add_action("b.parquet", 0, 2, 2))
    index.remove("a.parquet")
    assert [f.path for f in other.partition(0)] == ["a.parquet", "b.parquet"]
    assert index.partition(0) == []


def test_statistics_are_read_from_the_add_action() -> None:
    index = FileIndex()
    index.add(
        add_action(
            "partition_id=3/a%20b.parquet",
            3,
            7,
            9,
            min_available_at_utc="2026-01-02T03:04:05.006Z",
            max_enqueued_time_utc="2026-01-02T03:04:06Z",
            min_kind=KIND_MESSAGE,
            max_kind=KIND_MESSAGE,
            min_session_id="s1",
            max_session_id="s1",
            nulls_subscription=3,
        )
    )
    (f,) = index.partition(3)
    assert f.path == "partition_id=3/a b.parquet"  # paths in the log are URL-encoded
    assert (f.min_seq, f.max_seq, f.num_records, f.size_bytes) == (7, 9, 3, 100)
    assert f.min_available_at == datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)
    assert f.max_enqueued == datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC)
    assert (f.min_session, f.max_session, f.null_subscriptions) == ("s1", "s1", 3)


def test_parsed_statistics_from_a_delta_rs_checkpoint_are_read_too() -> None:
    index = FileIndex()
    action = add_action("a.parquet", 0, 4, 5)
    action["stats_parsed"] = json.loads(action.pop("stats"))
    index.add(action)
    (f,) = index.partition(0)
    assert (f.min_seq, f.max_seq) == (4, 5)


def info(**stats: Any) -> FileInfo:
    base: dict[str, Any] = {
        "path": "f.parquet",
        "partition": 0,
        "size_bytes": 1,
        "num_records": 1,
        "min_seq": 1,
        "max_seq": 1,
        "min_available_at": None,
        "max_enqueued": None,
        "min_sub_queue": SUB_QUEUE_MAIN,
        "max_sub_queue": SUB_QUEUE_MAIN,
    }
    return FileInfo(**{**base, **stats})


def test_may_hold_prunes_only_what_the_statistics_prove_absent() -> None:
    messages = info(min_kind=KIND_MESSAGE, max_kind=KIND_MESSAGE, null_subscriptions=1, min_session="b", max_session="d")
    assert messages.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, None)
    assert not messages.may_hold(KIND_SESSION, None, None)
    assert not messages.may_hold(KIND_MESSAGE, SUB_QUEUE_DEAD_LETTER, None)
    assert messages.may_hold(KIND_MESSAGE, None, None, "c")  # inside [b, d]
    assert not messages.may_hold(KIND_MESSAGE, None, None, "e")
    # A queue's rows have no subscription: a file whose subscription column has no null holds none of them.
    topic_copies = info(
        min_kind=KIND_MESSAGE, max_kind=KIND_MESSAGE, null_subscriptions=0, min_subscription="k1", max_subscription="k3"
    )
    assert not topic_copies.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, None)
    assert topic_copies.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, "k2")
    assert not topic_copies.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, "k4")
    assert topic_copies.may_hold(KIND_MESSAGE, SUB_QUEUE_MAIN, ANY_SUBSCRIPTION)
    # Missing statistics never prune: the file may hold anything.
    unknown = info(min_sub_queue=None, max_sub_queue=None)
    assert unknown.may_hold(KIND_SESSION, SUB_QUEUE_DEAD_LETTER, None, "any")
