"""Races between catalog readers and catalog maintenance, and between checkpointers of one table.

A catalog read takes its snapshot, then reads the snapshot's file: a commit that replaces the file
and a vacuum at retention 0 in between must not make the read report damage. A checkpointer of an
older version that finishes after one of a newer version must not move `_last_checkpoint` back.
Real namespaces in tmp_path; the only test double is a local store that pauses one read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from sparkqueue import Message, Namespace
from sparkqueue.errors import StorageCorruptedError, StorageError
from sparkqueue.storage.checkpoint import trim_log, write_checkpoint
from sparkqueue.storage.store import LocalStore


class _PausingStore(LocalStore):
    """A local store that runs `before_read` before each read of a catalog data file (not of the log)."""

    def __init__(self, root: str, before_read: Callable[[], None]) -> None:
        super().__init__(root)
        self.before_read = before_read

    def get(self, path: str) -> bytes:
        if path.endswith(".parquet") and not path.startswith("_delta_log/"):
            self.before_read()
        return super().get(path)


def _pause_catalog_reads(ns: Namespace, before_read: Callable[[], None]) -> None:
    """Make `ns` run `before_read` between taking its catalog snapshot and reading the snapshot's file."""
    catalog = ns.broker.catalog
    catalog.store = _PausingStore(catalog.store.uri, before_read)


def _once_paused(paused: threading.Event, resume: threading.Event) -> Callable[[], None]:
    """A `before_read` that stops the first read until `resume` is set; later reads run on."""

    def before_read() -> None:
        if not paused.is_set():
            paused.set()
            assert resume.wait(60)

    return before_read


@pytest.mark.parametrize("call", ["list", "create"])
def test_a_catalog_file_replaced_and_vacuumed_under_a_read_is_read_again_at_the_newer_version(root: str, call: str) -> None:
    """The reader's snapshot names the file the writer's commit replaced and its vacuum deleted: no damage, the newer rows.

    A change (create) computed from those rows commits against the version they were read at, so it lands first time.
    """
    writer = Namespace(root)
    writer.create_queue("a")
    reader = Namespace(root)
    assert [q.name for q in reader.list_queues()] == ["a"]
    writer.create_queue("b")  # the reader has not read this version's rows yet
    paused, resume = threading.Event(), threading.Event()
    _pause_catalog_reads(reader, _once_paused(paused, resume))
    result: dict[str, Any] = {}

    def read() -> None:
        try:
            if call == "create":
                reader.create_queue("d")
            result["names"] = [q.name for q in reader.list_queues()]
        except Exception as exc:  # handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=read)
    thread.start()
    try:
        assert paused.wait(60)
        writer.create_queue("c")  # replaces the catalog file the reader is about to read
        assert writer.run_maintenance(vacuum_retention=timedelta(0))["catalog"].vacuumed_files >= 1
    finally:
        resume.set()
        thread.join(60)
    assert "error" not in result, result.get("error")
    assert result["names"] == (["a", "b", "c", "d"] if call == "create" else ["a", "b", "c"])
    assert [q.name for q in Namespace(root).list_queues()] == result["names"]
    assert Namespace(root).check() == []


def test_a_live_catalog_file_that_is_missing_is_still_reported_as_damage(root: str) -> None:
    """A file live at the newest catalog version that is gone is damage, never an empty namespace."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        catalog = ns.broker.catalog
        (live,) = [a["path"] for a in catalog.log.load().files.actions()]
    os.unlink(f"{root}/_catalog/{live}")
    with pytest.raises(StorageCorruptedError, match=rf"namespace catalog .*: live file {live} is missing"):
        Namespace(root).list_queues()


def test_a_catalog_replaced_under_every_read_gives_up_after_a_few_reads(root: str) -> None:
    """A catalog replaced and vacuumed before each read of it raises StorageError (not damage) instead of looping."""
    writer = Namespace(root)
    writer.create_queue("a")
    reader = Namespace(root)
    changes: list[str] = []

    def replace_and_vacuum() -> None:
        changes.append(f"x{len(changes)}")
        writer.create_queue(changes[-1])
        writer.run_maintenance(vacuum_retention=timedelta(0))

    _pause_catalog_reads(reader, replace_and_vacuum)
    with pytest.raises(StorageError, match="replaced and vacuumed under") as raised:
        reader.list_queues()
    assert not isinstance(raised.value, StorageCorruptedError)
    assert 2 <= len(changes) <= 10
    assert [q.name for q in Namespace(root).list_queues()] == ["a", *changes]


class _FlakyLogStore(_PausingStore):
    """A `_PausingStore` whose first read of a log entry after `fail_next` is set fails as a dropped connection would."""

    fail_next = False

    def get(self, path: str) -> bytes:
        if path.startswith("_delta_log/") and self.fail_next:
            self.fail_next = False
            raise StorageError(f"{self.uri}: connection reset reading {path}")
        return super().get(path)


def test_a_transient_error_while_catching_up_after_a_vacuumed_catalog_file_is_retryable_not_damage(root: str) -> None:
    """The catalog file under a read was replaced and vacuumed, and the log read that tells so failed once.

    Before, that read failure was reported as damage (StorageCorruptedError: restore a backup) of a healthy catalog.
    """
    writer = Namespace(root)
    writer.create_queue("a")
    reader = Namespace(root)
    assert [q.name for q in reader.list_queues()] == ["a"]
    writer.create_queue("b")
    store: _FlakyLogStore

    def replace_vacuum_then_fail_once() -> None:
        if not store.fail_next and "c" not in [q.name for q in writer.list_queues()]:
            writer.create_queue("c")
            writer.run_maintenance(vacuum_retention=timedelta(0))
            store.fail_next = True

    catalog = reader.broker.catalog
    store = _FlakyLogStore(catalog.store.uri, replace_vacuum_then_fail_once)
    catalog.store = catalog.log.store = store
    with pytest.raises(StorageError, match="connection reset") as raised:
        reader.list_queues()
    assert not isinstance(raised.value, StorageCorruptedError)
    assert [q.name for q in reader.list_queues()] == ["a", "b", "c"]  # the retry reads the newer version


# ---- _last_checkpoint ---------------------------------------------------------------------------


def _queue_with_versions(ns: Namespace) -> tuple[Any, Any, Any]:
    """A queue's table and private snapshots of two of its versions, the older first."""
    ns.create_queue("q")
    table = ns.broker.entity("queue", "q").table
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("m0"), Message("m1")])
        s.send_messages(Message("m2"))
        old = table.snapshot().copy()
        s.send_messages(Message("m3"))
        s.send_messages(Message("m4"))
    new = table.snapshot().copy()
    assert new.version > old.version
    return table, old, new


def _last_checkpoint(table: Any) -> dict[str, Any]:
    return dict(json.loads(Path(table.uri, "_delta_log", "_last_checkpoint").read_bytes()))


def _age_log(table: Any, seconds: float) -> None:
    """Make every log file look `seconds` old (past the log retention)."""
    then = time.time() - seconds
    for name in os.listdir(Path(table.uri, "_delta_log")):
        os.utime(Path(table.uri, "_delta_log", name), (then, then))


def test_an_older_checkpoint_written_after_a_newer_one_leaves_last_checkpoint_at_the_newer(ns: Namespace) -> None:
    """The slower checkpointer writes its file but not the pointer; a trim then deletes its file, never the one named."""
    table, old, new = _queue_with_versions(ns)
    assert write_checkpoint(table.store, new)
    assert write_checkpoint(table.store, old)  # the slower checkpointer of the older version
    assert _last_checkpoint(table)["version"] == new.version
    _age_log(table, 3600)
    assert trim_log(table.store, new) > 0
    names = os.listdir(Path(table.uri, "_delta_log"))
    assert f"{new.version:020d}.checkpoint.parquet" in names and f"{old.version:020d}.checkpoint.parquet" not in names
    dt = DeltaTable(table.uri)
    assert dt.version() == new.version
    assert dt.to_pyarrow_table().num_rows == 5
    assert write_checkpoint(table.store, new)  # the same version again: the pointer stays
    assert _last_checkpoint(table)["version"] == new.version


@pytest.mark.parametrize("pointer", ["missing", "unreadable"])
def test_a_missing_or_unreadable_last_checkpoint_is_replaced(ns: Namespace, pointer: str) -> None:
    table, old, _ = _queue_with_versions(ns)
    path = Path(table.uri, "_delta_log", "_last_checkpoint")
    path.unlink(missing_ok=True)
    if pointer == "unreadable":
        path.write_bytes(b"{torn")
    assert write_checkpoint(table.store, old)
    assert _last_checkpoint(table)["version"] == old.version


def test_a_trim_keeps_the_checkpoint_a_lagging_last_checkpoint_names(ns: Namespace) -> None:
    """Two checkpointers that race past the pointer's check can leave it at the older one: the trim keeps what it names."""
    table, old, new = _queue_with_versions(ns)
    assert write_checkpoint(table.store, old)
    lagging = _last_checkpoint(table)
    assert write_checkpoint(table.store, new)
    Path(table.uri, "_delta_log", "_last_checkpoint").write_text(json.dumps(lagging))  # the older one wrote last
    _age_log(table, 3600)
    trim_log(table.store, new)
    names = os.listdir(Path(table.uri, "_delta_log"))
    assert f"{old.version:020d}.checkpoint.parquet" in names
    assert all(f"{v:020d}.json" in names for v in range(old.version + 1, new.version + 1))
    assert DeltaTable(table.uri).version() == new.version
    assert write_checkpoint(table.store, new)  # the next checkpoint moves the pointer on
    assert _last_checkpoint(table)["version"] == new.version
