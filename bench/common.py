"""Shared helpers for sparkqueue benchmarks: bodies and rows, timing, percentiles, floors, JSON output, profiles.

The benchmark machine is small and noisy (2 cores), so absolute figures move by tens of percent
between runs. Every benchmark therefore also measures *floors* in the same run, right next to the
figure it normalises, and reports the ratio:

- Parquet write floor: pyarrow writing the same rows as snappy Parquet files, one file per batch
  (no Delta log at all). No storage layer can append faster than this.
- Delta append floor: ``deltalake.write_deltalake(..., mode="append")`` of the same rows, one
  commit per batch (what a bare delta-rs producer pays).
- Delta commit latency floor: one ``write_deltalake`` append of a single small row (one commit).

Where possible the floors are measured *interleaved* with the figure (one floor step between two
timed sparkqueue steps), so a load spike from another process hits both alike.

The rows the floors write are sparkqueue-shaped (the entity table's schema, with a 1 KB random
body), so the byte volume matches what sparkqueue writes.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import math
import os
import platform
import pstats
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

BODY_SIZE = 1024
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- data ----------------------------------------------------------------------------------------


def random_bodies(n: int, size: int = BODY_SIZE) -> list[bytes]:
    """`n` incompressible bodies of `size` bytes (one os.urandom call, then sliced)."""
    raw = os.urandom(n * size)
    return [raw[i * size : (i + 1) * size] for i in range(n)]


def _entity_schema() -> pa.Schema:
    """sparkqueue's entity-table schema when importable, else a minimal message schema."""
    try:
        from sparkqueue.storage.schema import ENTITY_SCHEMA
    except ImportError:  # pragma: no cover - the library moved its schema
        return pa.schema(
            [
                pa.field("partition_id", pa.int32(), nullable=False),
                pa.field("sequence_number", pa.int64(), nullable=False),
                pa.field("enqueued_time_utc", pa.timestamp("us", tz="UTC"), nullable=False),
                pa.field("message_id", pa.string(), nullable=False),
                pa.field("body", pa.binary()),
            ]
        )
    return ENTITY_SCHEMA


def _zero(t: pa.DataType) -> Any:
    """A placeholder value for a non-nullable column the row builder does not know."""
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return 0
    if pa.types.is_timestamp(t):
        return datetime.now(UTC)
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_binary(t):
        return b""
    return ""


def message_rows(bodies: Sequence[bytes], *, partition: int = 0, first_seq: int = 1) -> pa.Table:
    """Rows shaped like a stored sparkqueue message (entity schema, UUID ids, given bodies): the floors' payload."""
    schema = _entity_schema()
    n = len(bodies)
    now = datetime.now(UTC)
    known: dict[str, Any] = {
        "partition_id": [partition] * n,
        "sequence_number": list(range(first_seq, first_seq + n)),
        "available_at_utc": [now] * n,
        "sub_queue": ["main"] * n,
        "state": ["active"] * n,
        "kind": ["message"] * n,
        "enqueued_time_utc": [now] * n,
        "delivery_count": [0] * n,
        "message_id": [str(uuid.uuid4()) for _ in range(n)],
        "size_in_bytes": [len(b) for b in bodies],
        "transfer_hop_count": [0] * n,
        "body": list(bodies),
    }
    arrays = []
    for f in schema:
        if f.name in known:
            arrays.append(pa.array(known[f.name], f.type))
        elif f.nullable:
            arrays.append(pa.nulls(n, f.type))
        else:
            arrays.append(pa.array([_zero(f.type)] * n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


# ---- timing and statistics ----------------------------------------------------------------------------


def bulk(sender: Any, messages: Sequence[Any]) -> Any:
    """Messages as one bulk batch: send_messages(list) keeps the SDK's 256 KB limit, a sized batch is one commit."""
    batch = sender.create_message_batch(max_size_in_bytes=sum(m.size_in_bytes for m in messages) + 1)
    for m in messages:
        batch.add_message(m)
    return batch


def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation between closest ranks; NaN when empty."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/min/max of latencies given in seconds, in milliseconds."""
    ms = [s * 1e3 for s in samples_s]
    return {
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "mean_ms": sum(ms) / len(ms) if ms else math.nan,
        "min_ms": min(ms) if ms else math.nan,
        "max_ms": max(ms) if ms else math.nan,
        "n": len(ms),
    }


def rate(count: int, seconds: float) -> float:
    """Items per second (NaN for a zero duration)."""
    return count / seconds if seconds > 0 else math.nan


def ratio(value: float, reference: float) -> float:
    """value / reference, NaN when the reference is zero or missing."""
    if not reference or math.isnan(reference):
        return math.nan
    return value / reference


@dataclass
class Clock:
    """Accumulates time spent in named phases (for breakdowns of a timed loop)."""

    totals: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block and add it to `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.totals[name] = self.totals.get(name, 0.0) + dt
            self.samples.setdefault(name, []).append(dt)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run fn once; return (its result, seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---- floors --------------------------------------------------------------------------------------


class ThroughputFloors:
    """Floors (a) and (b), measured interleaved with the figure they normalise.

    Call ``step(rows)`` once per batch the benchmark handles (between its own timed batches), so
    the floors and sparkqueue see the same machine load; ``result()`` gives msg/s per floor.

    (a) ``parquet_write``: pyarrow writes the batch as one snappy Parquet file (no Delta log).
    (b) ``delta_append``: ``deltalake.write_deltalake(mode="append")`` of the batch, one commit.
    """

    def __init__(self, scratch: Path) -> None:
        from deltalake import write_deltalake

        self._write_deltalake = write_deltalake
        tag = uuid.uuid4().hex[:8]
        self.parquet_dir = scratch / f"floor-parquet-{tag}"
        self.delta_uri = str(scratch / f"floor-delta-{tag}")
        self.parquet_dir.mkdir(parents=True, exist_ok=True)
        self.samples: dict[str, list[float]] = {"parquet_write": [], "delta_append": []}
        self.rows: dict[str, int] = {"parquet_write": 0, "delta_append": 0}
        self._created = False

    def step(self, rows: pa.Table) -> None:
        """Write one batch both ways, timing each."""
        partition_by = ["partition_id"] if "partition_id" in rows.column_names else None
        if not self._created:  # table creation and first-call setup are not part of the floor
            self._write_deltalake(self.delta_uri, rows.slice(0, 1), mode="append", partition_by=partition_by)
            pq.write_table(rows, self.parquet_dir / "warmup.parquet", compression="snappy")
            self._created = True
        i = len(self.samples["parquet_write"])
        t0 = time.perf_counter()
        pq.write_table(rows, self.parquet_dir / f"part-{i:05d}.parquet", compression="snappy")
        t1 = time.perf_counter()
        self._write_deltalake(self.delta_uri, rows, mode="append", partition_by=partition_by)
        t2 = time.perf_counter()
        self.samples["parquet_write"].append(t1 - t0)
        self.samples["delta_append"].append(t2 - t1)
        self.rows["parquet_write"] += rows.num_rows
        self.rows["delta_append"] += rows.num_rows

    def result(self) -> dict[str, dict[str, float]]:
        """msg/s of each floor over all steps (and from the median step, which shrugs off load spikes)."""
        out = {}
        for k, xs in self.samples.items():
            per_step = self.rows[k] / len(xs) if xs else 0
            out[k] = {
                "msg_per_s": rate(self.rows[k], sum(xs)),
                "msg_per_s_median_batch": rate(int(per_step), percentile(xs, 50)) if xs else math.nan,
                "seconds": sum(xs),
                "messages": self.rows[k],
                "batches": len(xs),
            }
        return out

    def close(self) -> None:
        """Delete the floors' files."""
        shutil.rmtree(self.parquet_dir, ignore_errors=True)
        shutil.rmtree(self.delta_uri, ignore_errors=True)


def measure_throughput_floors(batches: Sequence[pa.Table], scratch: Path) -> dict[str, dict[str, float]]:
    """Floors (a) and (b) over the given batches in one go (for benchmarks that cannot interleave)."""
    floors = ThroughputFloors(scratch)
    try:
        for b in batches:
            floors.step(b)
        return floors.result()
    finally:
        floors.close()


class CommitLatencyFloor:
    """Floor (c): latency of one ``write_deltalake`` append of a single 1 KB row (one commit), interleaved."""

    def __init__(self, scratch: Path, warmup: int = 5) -> None:
        from deltalake import write_deltalake

        self._write_deltalake = write_deltalake
        self.uri = str(scratch / f"floor-commit-{uuid.uuid4().hex[:8]}")
        self.row = message_rows(random_bodies(1))
        self.partition_by = ["partition_id"] if "partition_id" in self.row.column_names else None
        self.samples: list[float] = []
        for _ in range(warmup):
            self._commit()

    def _commit(self) -> None:
        self._write_deltalake(self.uri, self.row, mode="append", partition_by=self.partition_by)

    def step(self) -> None:
        """One timed single-row commit."""
        t0 = time.perf_counter()
        self._commit()
        self.samples.append(time.perf_counter() - t0)

    def result(self) -> dict[str, float]:
        """Latency percentiles in ms."""
        return latency_summary_ms(self.samples)

    def close(self) -> None:
        """Delete the floor's table."""
        shutil.rmtree(self.uri, ignore_errors=True)


def merge_floors(*runs: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Pool floor measurements taken at different times (e.g. before and after a multi-process benchmark)."""
    out: dict[str, dict[str, float]] = {}
    for k in runs[0]:
        msgs = sum(r[k]["messages"] for r in runs)
        secs = sum(r[k]["seconds"] for r in runs)
        out[k] = {
            "msg_per_s": rate(int(msgs), secs),
            "seconds": secs,
            "messages": msgs,
            "runs_msg_per_s": [r[k]["msg_per_s"] for r in runs],
        }
    return out


# ---- profiles ------------------------------------------------------------------------------------


class Profiler:
    """cProfile over chosen sections only (so interleaved floors stay out); a no-op unless enabled.

    ``with prof.section(): ...`` around the code under study, then ``prof.dump()`` writes the top
    entries by cumulative and by own time to ``results/profile-<name>.txt``.
    """

    def __init__(self, enabled: bool, name: str, top: int = 35) -> None:
        self.enabled = enabled
        self.name = name
        self.top = top
        self._prof = cProfile.Profile() if enabled else None

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """Profile the block (when enabled)."""
        if self._prof is None:
            yield
            return
        self._prof.enable()
        try:
            yield
        finally:
            self._prof.disable()

    def dump(self) -> Path | None:
        """Write the report; returns its path (None when disabled)."""
        if self._prof is None:
            return None
        out = io.StringIO()
        stats = pstats.Stats(self._prof, stream=out)
        stats.sort_stats("cumulative").print_stats(self.top)
        stats.sort_stats("tottime").print_stats(self.top)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"profile-{self.name}.txt"
        path.write_text(out.getvalue())
        print(f"  profile written to {path}", flush=True)
        return path


# ---- output --------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pyarrow": pa.__version__,
    }
    try:
        import deltalake

        info["deltalake"] = deltalake.__version__
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    try:
        import sparkqueue

        info["sparkqueue"] = sparkqueue.__version__
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return info


def write_results(path: Path, meta: dict[str, Any], results: dict[str, Any]) -> None:
    """Write results as JSON, keeping entries of benchmarks this run did not repeat (``--only``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged: dict[str, Any] = {}
    if path.exists():
        with contextlib.suppress(ValueError, OSError):
            merged = json.loads(path.read_text()).get("benchmarks", {})
    merged.update(results)
    path.write_text(json.dumps({"meta": meta, "benchmarks": merged}, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def fmt_rate(value: float) -> str:
    """A msg/s figure for humans."""
    return "n/a" if value is None or math.isnan(value) else f"{value:,.0f} msg/s"


def fmt_ratio(value: float) -> str:
    """A ratio for humans."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}x"


def verdict(ok: bool) -> str:
    """PASS/MISS label for a target check."""
    return "PASS" if ok else "MISS"


def heading(title: str) -> None:
    """Print a benchmark heading."""
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)), flush=True)


def row(label: str, value: str, note: str = "") -> None:
    """Print one aligned figure line."""
    print(f"  {label:<38} {value:>18}  {note}".rstrip(), flush=True)
