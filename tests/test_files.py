"""Data files (storage/files.py): statistics, small-file encoding, and writing a commit's files side by side."""

from __future__ import annotations

import logging
import os
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sparkqueue.errors import StorageCorruptedError, StorageError
from sparkqueue.message import Message, SendSettings, to_rows
from sparkqueue.storage import files as files_module
from sparkqueue.storage.files import FILE_SCHEMA, DataFiles, _encoded_bound, _stats, encode_parquet
from sparkqueue.storage.schema import index_of, member_of
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


def _reference_stats(rows: pa.Table) -> dict[str, object]:
    """Delta statistics computed the plain way: Arrow's min_max per column, timestamps as datetimes."""
    mins: dict[str, object] = {}
    maxs: dict[str, object] = {}
    for name in files_module.STATS_COLUMNS:
        col = rows.column(name)
        if col.null_count == len(col):
            continue
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if isinstance(lo, datetime):
            up = hi.microsecond % 1000 != 0
            hi = hi.replace(microsecond=hi.microsecond // 1000 * 1000) + timedelta(milliseconds=int(up))
            lo, hi = (t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z" for t in (lo, hi))
        mins[name], maxs[name] = lo, hi
    nulls = {name: rows.column(name).null_count for name in files_module.STATS_COLUMNS}
    return {"numRecords": rows.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


@pytest.mark.parametrize("n", [1, 2, 11, files_module.SMALL_STATS_ROWS, files_module.SMALL_STATS_ROWS + 1, 700])
def test_statistics_equal_arrow_min_max_for_small_and_large_files(n: int) -> None:
    """Bounds from Python values (small files) and from Arrow (large ones) equal a plain min_max, nulls and all."""
    rnd = random.Random(n)
    rows = _rows(n)
    base = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
    times = [None if rnd.random() < 0.3 else base + timedelta(microseconds=rnd.randrange(-(10**9), 10**9)) for _ in range(n)]
    words = [
        None if rnd.random() < 0.3 else rnd.choice(["a", "b", "zz", "é", "日本", ""]) + str(rnd.randrange(99)) for _ in range(n)
    ]
    rows = rows.set_column(
        rows.schema.get_field_index("locked_until_utc"),
        rows.field("locked_until_utc"),
        pa.array(times, pa.timestamp("us", tz="UTC")),
    )
    rows = rows.set_column(rows.schema.get_field_index("lock_token"), rows.field("lock_token"), pa.array(words, pa.string()))
    chunked = pa.concat_tables([rows.slice(0, n // 2), rows.slice(n // 2)])  # statistics over chunked columns too
    for t in (rows, chunked):
        assert _stats(t) == _reference_stats(t)


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


def _varied_file(rng: random.Random, n: int) -> pa.Table:
    """n rows of the file schema, each nullable column all null, every other row null, or full, at random."""
    cols: dict[str, pa.Array] = {}
    for f in FILE_SCHEMA:
        mode = rng.choice(["null", "alternate", "full"]) if f.nullable else "full"
        values: list[object]
        if pa.types.is_binary(f.type) or pa.types.is_string(f.type):
            size = rng.choice([0, 1, 40, 1024, 70_000 if n < 10 else 3])
            values = [os.urandom(size) if pa.types.is_binary(f.type) else os.urandom(size // 2).hex() for _ in range(n)]
        elif pa.types.is_boolean(f.type):
            values = [rng.random() < 0.5 for _ in range(n)]
        elif pa.types.is_timestamp(f.type):
            values = [datetime(2026, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**12)) for _ in range(n)]
        else:
            values = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        if mode == "null":
            values = [None] * n
        elif mode == "alternate":
            values = [v if i % 2 else None for i, v in enumerate(values)]
        cols[f.name] = pa.array(values, f.type)
    return pa.table(cols, schema=FILE_SCHEMA)


def test_files_are_encoded_within_their_size_bound_and_read_back_whole(caplog: pytest.LogCaptureFixture) -> None:
    """The one-buffer encoding's bound holds for files of every shape, slices of larger tables included; rows round-trip."""
    rng = random.Random(7)
    caplog.set_level(logging.DEBUG, logger="sparkqueue.storage.files")
    for _ in range(60):
        rows = _varied_file(rng, rng.choice([1, 2, 7, 100, 1000]))
        if rows.num_rows > 2 and rng.random() < 0.3:
            rows = rows.slice(1, rows.num_rows - 2)
        data = encode_parquet(rows)
        assert pq.read_table(pa.BufferReader(data)).cast(FILE_SCHEMA).equals(rows)
        assert len(data) <= _encoded_bound(rows)
    assert "again in a growing stream" not in caplog.text


def test_a_file_past_its_size_bound_is_encoded_whole_all_the_same(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Should the bound ever fall short, the file is encoded again by a growing stream, never cut."""
    caplog.set_level(logging.DEBUG, logger="sparkqueue.storage.files")
    monkeypatch.setattr(files_module, "_encoded_bound", lambda rows: 64)
    rows = _rows(50).cast(FILE_SCHEMA)
    assert pq.read_table(pa.BufferReader(encode_parquet(rows))).cast(FILE_SCHEMA).equals(rows)
    assert "again in a growing stream" in caplog.text  # what the test above looks for


def test_index_of_and_member_of_answer_as_arrow_index_in_and_is_in() -> None:
    """The binary-search lookups agree with pc.index_in / pc.is_in: duplicates, unsorted and chunked keys, misses, nulls."""
    rng = random.Random(3)
    cases: list[tuple[pa.Array | pa.ChunkedArray, pa.Array | pa.ChunkedArray]] = [
        (pa.array([], pa.int64()), pa.array([1, 2], pa.int64())),
        (pa.array([5, 6], pa.int64()), pa.array([], pa.int64())),
        (pa.array([1, None, 3], pa.int64()), pa.array([3, 1], pa.int64())),  # nulls: Arrow's answer
        (pa.array([1, 2, 3], pa.int32()), pa.array([3, 9], pa.int32())),
    ]
    for _ in range(200):
        keys = [rng.randrange(-5, 40) + (rng.randrange(3) << 48) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.5:
            keys.sort()
        values = [rng.randrange(-5, 40) + (rng.randrange(3) << 48) for _ in range(rng.randrange(0, 30))]
        half = len(keys) // 2
        key_array = pa.chunked_array([keys[:half], keys[half:]], pa.int64()) if rng.random() < 0.3 else pa.array(keys, pa.int64())
        cases.append((pa.array(values, pa.int64()), key_array))
    for values, keys in cases:
        expected = pc.index_in(values, value_set=keys)
        assert index_of(values, keys).to_pylist() == expected.to_pylist()
        assert member_of(values, keys).to_pylist() == pc.is_in(values, value_set=keys).to_pylist()


def test_files_are_cut_by_the_rows_sliced_size_even_when_they_slice_a_larger_table() -> None:
    """Rows cut from a larger table (a send's batch) are weighed by what they hold, not by the buffers they share."""
    rnd = random.Random(5)
    for _ in range(200):
        n = rnd.choice([2, 50, 999, 1000, 1001, 4000, 9000])
        body = rnd.choice([10, 1000, 9000, 40000])
        big = pa.table({"body": pa.array([b"x" * body] * (n + rnd.randrange(0, 2000)))})
        rows = big.slice(rnd.randrange(0, big.num_rows - n + 1), n)
        for max_rows in (100, 1000, 4000):
            per_row = max(1, rows.nbytes // n)
            scale = max(max_rows, files_module.MAX_FILE_ROWS) / files_module.MAX_FILE_ROWS
            step = max(1, min(max_rows, int(files_module.MAX_FILE_BYTES * scale) // per_row))
            expected = [min(step, n - i) for i in range(0, n, step)]
            assert [t.num_rows for t in files_module._chunks(rows, max_rows)] == expected
