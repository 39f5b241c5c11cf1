"""Data files (storage/files.py): statistics, small-file encoding, and writing a commit's files side by side."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkqueue.errors import StorageCorruptedError, StorageError
from sparkqueue.message import Message, SendSettings, to_rows
from sparkqueue.storage.files import FILE_SCHEMA, DataFiles, _stats
from sparkqueue.storage.store import LocalStore


def _rows(n: int) -> pa.Table:
    """n varied message rows in the file schema."""
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    msgs = [
        Message(f"b{i}".encode(), subject=f"s{i}" if i % 2 else None, time_to_live=timedelta(seconds=i + 1)) for i in range(n)
    ]
    rows, _ = to_rows(msgs, SendSettings("standard", False, False, None), now)
    seqs = pa.array(range(10, 10 + n), pa.int64())
    return rows.set_column(rows.schema.get_field_index("sequence_number"), "sequence_number", seqs).select(FILE_SCHEMA.names)


@pytest.mark.parametrize("index", [0, 1])
def test_one_row_statistics_equal_the_general_computation(index: int) -> None:
    """The one-row shortcut gives the bounds and null counts that min/max over the column give."""
    one = _rows(2).slice(index, 1)
    two = pa.concat_tables([one, one])  # same bounds, computed by the general path
    fast, general = _stats(one), _stats(two)
    assert fast["minValues"] == general["minValues"]
    assert fast["maxValues"] == general["maxValues"]
    assert {k: 2 * v for k, v in fast["nullCount"].items()} == general["nullCount"]  # type: ignore[union-attr]
    assert fast["numRecords"] == 1


def test_small_and_large_files_read_back_the_same_rows(tmp_path: Path) -> None:
    """Files of a few rows (no dictionaries or Parquet statistics) and larger ones hold exactly the rows written."""
    files = DataFiles(LocalStore(str(tmp_path)), cache_bytes=0)
    for n in (1, 3, 500):
        rows = _rows(n).cast(FILE_SCHEMA)
        add = files.write(0, rows)
        assert pq.read_table(tmp_path / add.path).cast(FILE_SCHEMA).equals(rows)
        assert files.read(add.path).equals(rows)


def test_write_all_writes_every_piece_in_order_and_cleans_up_on_failure(tmp_path: Path) -> None:
    """Pieces for many partitions come back in order; when one write fails, no file of the batch remains."""
    files = DataFiles(LocalStore(str(tmp_path)))
    pieces = [(p, _rows(3).cast(FILE_SCHEMA), 2) for p in range(6)]
    written = files.write_all(pieces)
    assert [len(adds) for adds in written] == [2] * 6  # 3 rows at most 2 per file
    assert [a.partition_values["partition_id"] for adds in written for a in adds] == [str(p) for p in range(6) for _ in (0, 1)]
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.parquet")}
    blocker = tmp_path / "partition_id=9"
    blocker.write_text("a file where a directory must go")  # partition 9's write fails
    with pytest.raises(StorageError):
        files.write_all([(p, _rows(2).cast(FILE_SCHEMA), 1000) for p in (7, 8, 9, 10)])
    after = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.parquet")}
    assert after == before
    assert os.path.isfile(blocker)


@pytest.mark.parametrize("damage", ["missing column", "not parquet"])
def test_a_damaged_data_file_is_reported_never_read_short(tmp_path: Path, damage: str) -> None:
    """A data file that lacks a column, or is not Parquet, raises StorageCorruptedError naming it."""
    files = DataFiles(LocalStore(str(tmp_path)), cache_bytes=0)
    rows = _rows(3).cast(FILE_SCHEMA)
    path = tmp_path / "partition_id=0" / "part-x.lz4.parquet"
    path.parent.mkdir()
    if damage == "missing column":
        pq.write_table(rows.drop_columns(["subject"]), path)
    else:
        path.write_bytes(b"not a parquet file" * 10)
    with pytest.raises(StorageCorruptedError, match="part-x"):
        files.read("partition_id=0/part-x.lz4.parquet", ["sequence_number", "subject"])


def test_conform_relabels_nullability_casts_types_and_refuses_nulls_in_a_non_null_field() -> None:
    from sparkqueue.storage.schema import conform

    target = pa.schema([pa.field("seq", pa.int64(), nullable=False), pa.field("n", pa.int32())])
    relabelled = conform(pa.table({"seq": pa.array([1, 2], pa.int64()), "n": pa.array([3, None], pa.int32())}), target)
    assert relabelled.schema.equals(target) and relabelled.column("n").to_pylist() == [3, None]
    cast = conform(pa.table({"seq": pa.array([1, 2], pa.int32()), "n": pa.array([3, 4], pa.int64())}), target)
    assert cast.schema.equals(target) and cast.column("seq").to_pylist() == [1, 2]
    with pytest.raises(ValueError, match="non-nullable"):
        conform(pa.table({"seq": pa.array([1, None], pa.int64()), "n": pa.array([3, 4], pa.int32())}), target)


def test_keep_rows_is_filter_without_a_copy_when_every_row_stays_and_drops_nulls() -> None:
    from sparkqueue.storage.schema import keep_rows

    t = pa.table({"sequence_number": pa.array([3, 1, 2], pa.int64()), "body": [b"a", b"b", b"c"]})
    assert keep_rows(t, pa.array([True, True, True])) is t
    assert keep_rows(t, pa.array([True, None, True])).column("sequence_number").to_pylist() == [3, 2]
    assert keep_rows(t, pa.array([False, True, False])).column("body").to_pylist() == [b"b"]


def test_in_sequence_sorts_out_of_order_rows_and_leaves_ordered_ones_as_they_are() -> None:
    from sparkqueue.storage.schema import in_sequence

    ordered = pa.concat_tables([pa.table({"sequence_number": pa.array(v, pa.int64())}) for v in ([1, 2], [5, 9])])
    assert in_sequence(ordered) is ordered
    mixed = pa.concat_tables([pa.table({"sequence_number": pa.array(v, pa.int64())}) for v in ([4, 8], [1, 9])])
    assert in_sequence(mixed).column("sequence_number").to_pylist() == [1, 4, 8, 9]
