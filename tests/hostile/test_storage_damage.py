"""Damaged storage is detected and reported, never read as empty; partition-local damage stays in its partition.

Each test damages a real namespace the way a failing disk, a power loss or a careless copy would,
on a local disk and (where the damage can be made there) on Azurite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from azurite import Store
from procs import drain_all, key_for_partition

from sparkqueue import Message, Namespace
from sparkqueue.errors import PartitionUnavailableError, StorageCorruptedError
from sparkqueue.storage import check
from sparkqueue.storage.log import entry_actions


def _queue_table(ns: Namespace, name: str = "q") -> object:
    return ns.broker.entity("queue", name).table


def _newest_entry(table: object) -> str:
    names = sorted(e.path for e in table.store.list("_delta_log/") if e.path.endswith(".json"))  # type: ignore[attr-defined]
    return names[-1]


def test_a_zero_byte_newest_commit_is_an_error_and_no_sequence_number_is_reused(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q", enable_partitioning=False)
        seqs = []
        with ns.get_queue_sender("q") as s:
            for i in range(10):
                seqs += s.send_messages(Message(f"m{i}"))
        table = _queue_table(ns)
        newest = _newest_entry(table)
        table.store.put(newest, b"")  # what a torn write leaves
    with store.open() as ns:
        with pytest.raises(StorageCorruptedError, match="empty"):
            ns.get_queue_runtime_properties("q")
        with pytest.raises(StorageCorruptedError), ns.get_queue_sender("q") as s:
            s.send_messages(Message("after"))
        findings = ns.check()
        assert len(findings) == 1 and "empty" in findings[0].problem and not findings[0].repaired
        repaired = ns.check(repair=True)
        assert repaired[0].repaired
        assert ns.check() == []
        # The torn entry was the last send: nine messages remain and the next number is new.
        assert ns.get_queue_runtime_properties("q").active_message_count == 9
        with ns.get_queue_sender("q") as s:
            (new,) = s.send_messages(Message("after"))
        assert new > max(seqs[:9]) and new not in seqs[:9]


def test_a_truncated_newest_commit_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with Namespace(tmp_path / "ns") as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("x"))
        table = _queue_table(ns)
        newest = _newest_entry(table)
        table.store.put(newest, table.store.get(newest)[:25])  # type: ignore[attr-defined]
    with Namespace(tmp_path / "ns") as ns, pytest.raises(StorageCorruptedError, match=Path(newest).name):
        ns.get_queue_receiver("q").receive_messages(1)


@pytest.mark.parametrize("cut", ["adds", "removes"])
def test_an_entry_cut_at_a_line_boundary_is_damage_not_a_smaller_commit(store: Store, cut: str) -> None:
    """A send's entry cut after its txn line lost its messages silently; a completion's, cut before its removes, brought
    completed messages back. Every entry counts its actions: check() reports it, and repair sets the newest one aside."""
    with store.open() as ns:
        ns.create_queue("q", enable_partitioning=False)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}") for i in range(5)])
        if cut == "removes":
            with ns.get_queue_receiver("q") as r:
                r.complete_messages(r.receive_messages(5, max_wait_time=5))
        table = _queue_table(ns)
        newest = _newest_entry(table)
        lines = table.store.get(newest).splitlines(keepends=True)  # type: ignore[attr-defined]
        kept = [line for line in lines if b'"add"' not in line and b'"remove"' not in line]
        table.store.put(newest, b"".join(kept))  # type: ignore[attr-defined]
    with store.open() as ns:
        with pytest.raises(StorageCorruptedError, match="cut short"):
            ns.get_queue_runtime_properties("q")
        (finding,) = ns.check()
        assert "cut short" in finding.problem and Path(newest).name in finding.problem
        assert ns.check(repair=True)[0].repaired
        assert ns.check() == []
        left = ns.get_queue_runtime_properties("q").active_message_count
        assert left == (0 if cut == "adds" else 5)  # the entry replaced by an empty one: as before it
        assert entry_actions(_queue_table(ns).store.get(newest))[0]["commitInfo"]["operation"] == "REPAIR"  # type: ignore[attr-defined]


def _in_child(root: Path, code: str) -> str:
    """Run `code` with `ns` open on the namespace in a separate process; its output."""
    program = f"from sparkqueue import Message, Namespace\nns = Namespace({str(root)!r})\n{code}"
    return subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True, timeout=120).stdout


def test_repairing_an_acknowledged_entry_cut_later_never_frees_its_version(tmp_path: Path) -> None:
    """Damage can cut an entry that was acknowledged and read: a process holding it must never see its version reused.

    The repair set the cut entry aside, freeing its version; another process's send took it, and a checkpoint
    the first process then wrote (holding the original entry) made fresh readers lose that acknowledged send.
    The version now stays taken by an entry that changes nothing.
    """
    root = tmp_path / "ns"
    with Namespace(root) as p:
        p.create_queue("q", enable_partitioning=False)
        with p.get_queue_sender("q") as s:
            s.send_messages([Message(f"A{i}") for i in range(5)])
            s.send_messages([Message(f"B{i}") for i in range(5)])  # acknowledged, and read by this process
        table = _queue_table(p)
        newest = _newest_entry(table)
        data = table.store.get(newest)  # type: ignore[attr-defined]
        table.store.put(newest, data[: len(data) // 2])  # type: ignore[attr-defined]
        assert "True" in _in_child(root, "print([f.repaired for f in ns.check(repair=True)])")
        _in_child(root, "ns.get_queue_sender('q').send_messages([Message(f'D{i}') for i in range(5)])")
        p.run_maintenance(vacuum=False)  # a checkpoint of this process's state: it read the cut entry whole
    peek = "print(sorted(str(m) for m in ns.get_queue_receiver('q').peek_messages(100)))"
    seen = _in_child(root, peek)
    assert all(f"D{i}" in seen for i in range(5)), seen  # the other process's acknowledged send is there


def test_a_deleted_catalog_log_is_reported_not_opened_empty(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("x"))
        catalog = ns.store.child("_catalog")
        for e in catalog.list("_delta_log/"):
            catalog.delete(e.path)
    with pytest.raises(StorageCorruptedError, match="catalog"):
        store.open()


def test_an_emptied_catalog_entry_is_reported(tmp_path: Path) -> None:
    with Namespace(tmp_path / "ns") as ns:
        ns.create_queue("q")
    log_dir = tmp_path / "ns" / "_catalog" / "_delta_log"
    newest = sorted(log_dir.glob("*.json"))[-1]
    newest.write_bytes(b"")
    with pytest.raises(StorageCorruptedError):
        Namespace(tmp_path / "ns")


def _foreign_parquet() -> bytes:
    """A readable Parquet file that is not what the table holds."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1, 2, 3]}), sink)
    return bytes(sink.getvalue().to_pybytes())


def _damaged(data: bytes, damage: str) -> bytes:
    return {"truncated": data[: len(data) // 2], "zeroed": bytes(len(data)), "empty": b"", "foreign": _foreign_parquet()}[damage]


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "empty", "foreign"])
def test_a_damaged_catalog_file_is_an_error_naming_it_and_nothing_touches_it(store: Store, damage: str) -> None:
    """A live catalog file that cannot be read as the catalog raises StorageCorruptedError naming the catalog and the file.

    Never a raw Arrow error, never an empty namespace; check, repair and maintenance leave the file as it is.
    """
    with store.open() as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("x"))
        catalog = ns.broker.catalog
        (live,) = [a["path"] for a in catalog.log.load().files.actions()]
        catalog.store.put(live, _damaged(catalog.store.get(live), damage))
        bad = catalog.store.get(live)
    calls = {
        "list": lambda ns: ns.list_queues(),
        "send": lambda ns: ns.get_queue_sender("q").send_messages(Message("y")),
        "check": lambda ns: ns.check(),
        "repair": lambda ns: ns.check(repair=True),
        "maintenance": lambda ns: ns.run_maintenance(vacuum_retention=timedelta(0)),
    }
    for what, call in calls.items():
        with pytest.raises(StorageCorruptedError, match=rf"catalog .*{re.escape(live)} is damaged"), store.open() as ns:
            call(ns)
        assert catalog.store.get(live) == bad, what


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "foreign", "other rows"])
def test_check_reports_an_unreadable_data_file_and_repair_leaves_it(store: Store, damage: str) -> None:
    """check() reads every live file's Parquet footer: one it cannot parse, or one counting other rows than the
    log says, is reported. Repair leaves it (its bytes may still be saved); deleted, it is dropped as missing."""
    with store.open() as ns:
        ns.create_queue("q", enable_partitioning=False)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"a{i}") for i in range(3)])
            s.send_messages([Message(f"b{i}") for i in range(5)])
        table = _queue_table(ns)
        first, second = sorted(table.snapshot().files, key=lambda f: f.min_seq)  # type: ignore[attr-defined]
        data = table.store.get(first.path)  # type: ignore[attr-defined]
        bad = table.store.get(second.path) if damage == "other rows" else _damaged(data, damage)  # type: ignore[attr-defined]
        table.store.put(first.path, bad)  # type: ignore[attr-defined]
    with store.open() as ns:
        (found,) = ns.check()
        assert first.path in found.problem and "unreadable" in found.problem and not found.repaired
        if damage == "other rows":
            assert "counts 5 rows, its add action 3" in found.problem
        (again,) = ns.check(repair=True)
        assert not again.repaired
        assert table.store.get(first.path) == bad  # type: ignore[attr-defined]
        table.store.delete(first.path)  # what the operator does once the file is saved or given up
        (dropped,) = ns.check(repair=True)
        assert dropped.repaired and "missing" in dropped.problem
        assert ns.check() == []
        assert ns.get_queue_runtime_properties("q").active_message_count == 5


def test_check_reads_a_footer_larger_than_its_first_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A footer beyond the first ranged read of a file's tail is read whole: intact files are not reported."""
    monkeypatch.setattr(check, "FOOTER_READ", 16)
    with Namespace(tmp_path / "ns") as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}", partition_key=f"k{i}") for i in range(40)])
        assert ns.check() == []
        table = _queue_table(ns)
        victim = next(iter(table.snapshot().files))  # type: ignore[attr-defined]
        table.store.put(victim.path, b"\0" * victim.size_bytes)  # type: ignore[attr-defined]
        (found,) = ns.check()
        assert victim.path in found.problem and "footer cannot be read" in found.problem


def test_a_deleted_data_file_makes_only_its_partition_unavailable(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q")
        damaged_key = key_for_partition(5)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"d{i}", message_id=f"d{i}", partition_key=damaged_key) for i in range(10)])
            for p in (1, 2, 3):
                s.send_messages(
                    [Message(f"ok{p}-{i}", message_id=f"ok{p}-{i}", partition_key=key_for_partition(p)) for i in range(10)]
                )
        table = _queue_table(ns)
        (victim,) = [f for f in table.snapshot().files if f.partition == 5]  # type: ignore[attr-defined]
        table.store.delete(victim.path)  # type: ignore[attr-defined]
    with store.open() as ns:
        with ns.get_queue_receiver("q", max_wait_time=1) as r:
            got = drain_all(r)
        assert sorted(m.message_id for m in got) == sorted(f"ok{p}-{i}" for p in (1, 2, 3) for i in range(10))
        rp = ns.get_queue_runtime_properties("q")
        assert rp.availability_status == "Limited"
        assert rp.active_message_count == 30
        findings = ns.check()
        assert len(findings) == 1 and victim.path in findings[0].problem
        assert ns.check(repair=True)[0].repaired
    with store.open() as ns:
        assert ns.check() == []
        assert ns.get_queue_runtime_properties("q").availability_status == "Available"


@pytest.mark.parametrize("damage", ["deleted", "truncated", "zeroed"])
def test_a_damaged_only_data_file_is_reported_by_peek_and_receive_never_read_as_empty(tmp_path: Path, damage: str) -> None:
    """The only data file of a one-partition queue damaged: peek and receive returned [] as if its 10 messages did not
    exist. Both raise PartitionUnavailableError naming the partition; runtime properties report it as "Limited";
    restored, the file reads again in full."""
    root = tmp_path / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}") for i in range(10)])
        table = _queue_table(ns)
        (victim,) = table.snapshot().files  # type: ignore[attr-defined]
        data = table.store.get(victim.path)  # type: ignore[attr-defined]
        if damage == "deleted":
            table.store.delete(victim.path)  # type: ignore[attr-defined]
        else:
            table.store.put(victim.path, _damaged(data, damage))  # type: ignore[attr-defined]
    for first in ("peek", "receive"):  # the first read of a fresh process finds the damage, or meets its mark
        with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
            calls = {"peek": lambda: r.peek_messages(50), "receive": lambda: r.receive_messages(50, max_wait_time=0.5)}
            for what in (first, *(c for c in calls if c != first)):
                with pytest.raises(PartitionUnavailableError, match=r"partition\(s\) 0 of 'q'.*partition_id=0/part-"):
                    calls[what]()
            rp = ns.get_queue_runtime_properties("q")
            assert (rp.availability_status, rp.total_message_count) == ("Limited", 0)
    Path(table.uri, victim.path).write_bytes(data)  # type: ignore[attr-defined]
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        assert len(r.peek_messages(50)) == 10
        assert len(drain_all(r)) == 10


def test_a_damaged_session_partition_is_reported_by_accepts_and_session_listing(tmp_path: Path) -> None:
    """A session queue whose only data file is gone: NEXT_AVAILABLE_SESSION, once the partition is marked unavailable,
    timed out as if no session had messages, and the session listing was empty. Both raise PartitionUnavailableError."""
    from sparkqueue import NEXT_AVAILABLE_SESSION

    root = tmp_path / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q", requires_session=True, enable_partitioning=False)
        ns.get_queue_sender("q").send_messages([Message(f"m{i}", session_id="s1") for i in range(5)])
        table = _queue_table(ns)
        (victim,) = table.snapshot().files  # type: ignore[attr-defined]
        table.store.delete(victim.path)  # type: ignore[attr-defined]
    with Namespace(root) as ns:
        with pytest.raises(PartitionUnavailableError):
            ns.get_queue_receiver("q", session_id="s1")  # the read that finds the damage
        with pytest.raises(PartitionUnavailableError, match="no session was accepted"):
            ns.get_queue_receiver("q", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.3)
        with pytest.raises(PartitionUnavailableError, match="sessions were not listed"):
            ns.list_queue_sessions("q")


def test_receiving_deferred_messages_of_a_damaged_partition_raises(tmp_path: Path) -> None:
    """receive_deferred_messages never reads damage as 'no such deferred message' or as nothing: it raises
    PartitionUnavailableError, in a fresh process and again once the partition is marked."""
    root = tmp_path / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
        ns.get_queue_sender("q").send_messages([Message(f"m{i}") for i in range(5)])
        with ns.get_queue_receiver("q") as r:
            got = r.receive_messages(5, max_wait_time=5)
            for m in got:
                r.defer_message(m)
        table = _queue_table(ns)
        for f in table.snapshot().files:  # type: ignore[attr-defined]
            table.store.put(f.path, _damaged(table.store.get(f.path), "zeroed"))  # type: ignore[attr-defined]
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        for _ in range(2):
            with pytest.raises(PartitionUnavailableError, match="partition 0"):
                r.receive_deferred_messages([m.sequence_number for m in got])


@pytest.mark.parametrize("pointer", ["future version", "one past the newest entry", "unreadable", "no checkpoint left"])
def test_check_reports_and_repairs_a_last_checkpoint_naming_no_checkpoint(tmp_path: Path, pointer: str) -> None:
    """A `_last_checkpoint` naming a version with no checkpoint made delta-rs refuse the table ("Had a _last_checkpoint
    hint but didn't find any checkpoints") while check() found nothing. check() reports it; repair points it at the
    newest checkpoint, or removes it when none is left, and delta-rs reads the table again."""
    from deltalake import DeltaTable

    with Namespace(tmp_path / "ns") as ns:
        ns.create_queue("q", enable_partitioning=False)
        ns.get_queue_sender("q").send_messages([Message(f"m{i}") for i in range(3)])
        checkpointed = ns.run_maintenance(vacuum=False)["queue:q"].checkpointed_version
        assert checkpointed is not None
        ns.get_queue_sender("q").send_messages(Message("after"))
        table = _queue_table(ns)
        pointer_path = "_delta_log/_last_checkpoint"
        newest = int(Path(_newest_entry(table)).name[:20])
        content = {
            "future version": b'{"version": 999999, "size": 3}',
            "one past the newest entry": f'{{"version": {newest + 1}, "size": 3}}'.encode(),
            "unreadable": b"{{{not json",
            "no checkpoint left": table.store.get(pointer_path),  # type: ignore[attr-defined]
        }[pointer]
        table.store.put(pointer_path, content)  # type: ignore[attr-defined]
        if pointer == "no checkpoint left":
            table.store.delete(f"_delta_log/{checkpointed:020d}.checkpoint.parquet")  # type: ignore[attr-defined]
        if pointer != "unreadable":  # delta-rs lists the log when the hint is unreadable
            with pytest.raises(Exception, match="_last_checkpoint"):
                DeltaTable(table.uri)  # type: ignore[attr-defined]
        (found,) = ns.check()
        assert "_last_checkpoint" in found.problem and not found.repaired
        (fixed,) = ns.check(repair=True)
        assert fixed.repaired
        assert ns.check() == []
        if pointer == "no checkpoint left":
            assert not table.store.exists(pointer_path)  # type: ignore[attr-defined]
        else:
            assert json.loads(table.store.get(pointer_path))["version"] == checkpointed  # type: ignore[attr-defined]
        assert DeltaTable(table.uri).to_pyarrow_table().num_rows == 4  # type: ignore[attr-defined]
        assert ns.get_queue_runtime_properties("q").active_message_count == 4


def test_runtime_properties_report_damage_found_by_their_own_read_as_limited(tmp_path: Path) -> None:
    """The first call in a fresh process (every CLI run) reports the damaged partition as unavailable instead of raising."""
    with Namespace(str(tmp_path / "ns")) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}", partition_key=key_for_partition(p)) for p in (2, 7) for i in range(3)])
        table = _queue_table(ns)
        (victim,) = [f for f in table.snapshot().files if f.partition == 7]  # type: ignore[attr-defined]
        table.store.delete(victim.path)  # type: ignore[attr-defined]
    with Namespace(str(tmp_path / "ns")) as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert rp.availability_status == "Limited"
        assert [p.partition_id for p in rp.partitions if not p.available] == [7]
        assert rp.active_message_count == 3


def test_maintenance_and_forwarding_skip_a_damaged_entity_and_do_the_rest(tmp_path: Path) -> None:
    with Namespace(tmp_path / "ns") as ns:
        ns.create_queue("bad")
        ns.create_queue("good")
        ns.get_queue_sender("bad").send_messages(Message("x"))
        ns.get_queue_sender("good").send_messages([Message("y") for _ in range(3)])
        bad = _queue_table(ns, "bad")
        bad.store.put(_newest_entry(bad), b"")  # type: ignore[attr-defined]
    with Namespace(tmp_path / "ns") as ns:
        reports = ns.run_maintenance()
        assert reports["queue:bad"].error is not None and "empty" in reports["queue:bad"].error
        assert reports["queue:good"].error is None and reports["queue:good"].checkpointed_version is not None
        ns.forward_pending_messages()  # does not raise for the damaged queue
        assert [q.name for q in ns.list_queues()] == ["bad", "good"]


def test_a_copied_namespace_is_independent_of_the_original(tmp_path: Path) -> None:
    original = tmp_path / "original"
    with Namespace(original) as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages([Message(f"m{i}") for i in range(5)])
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    with Namespace(copy) as ns:
        with ns.get_queue_receiver("q") as r:
            r.complete_messages(drain_all(r))
        ns.get_queue_sender("q").send_messages(Message("only in the copy"))
        ns.delete_queue("q")
    with Namespace(original) as ns:
        assert ns.get_queue_runtime_properties("q").active_message_count == 5


def test_a_relative_root_opens_the_same_namespace_from_another_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    code = (
        "from sparkqueue import Namespace, Message\n"
        "ns = Namespace('rel-ns'); ns.create_queue('q')\n"
        "ns.get_queue_sender('q').send_messages(Message('from a relative root'))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=work, check=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        f"from sparkqueue import Namespace\nns = Namespace({str(work / 'rel-ns')!r})\n"
        "print([str(m) for m in ns.get_queue_receiver('q').receive_messages(5, max_wait_time=2)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['from a relative root']"
    assert not any(Path(elsewhere).iterdir())


def test_files_are_created_with_the_process_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with Namespace(tmp_path / "ns") as ns:
            ns.create_queue("q")
            ns.get_queue_sender("q").send_messages(Message("x"))
    finally:
        os.umask(old)
    written = [p for p in (tmp_path / "ns").rglob("*") if p.is_file() and "partition_id=" in str(p)]
    assert written and all(p.stat().st_mode & 0o007 == 0 for p in written)


def test_cli_check_reports_and_repairs(tmp_path: Path) -> None:
    root = tmp_path / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages([Message("a"), Message("b")])
        table = _queue_table(ns)
        table.store.put(_newest_entry(table), b"")  # type: ignore[attr-defined]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sparkqueue.cli", "--root", str(root), *args], capture_output=True, text=True, timeout=120
        )

    found = cli("check")
    assert found.returncode == 1 and "damaged" in found.stdout and "empty" in found.stdout and "--repair" in found.stderr
    fixed = cli("check", "--repair")
    assert fixed.returncode == 0 and "repaired" in fixed.stdout
    clean = cli("check")
    assert clean.returncode == 0 and "No damage found" in clean.stdout
