"""The namespace catalog: one small Delta table mapping entity names to their tables and settings.

The catalog's rows live in one Parquet file; every change writes the new rows to a new file and
commits it with the removal of the old one (log.py), which maintenance vacuums later
(maintenance.maintain_catalog, with the log entries behind its checkpoint). Two concurrent changes both remove the same
file, so the second one's commit conflicts, re-reads and re-applies: a create of a name that the
winner inserted inserts nothing, and exactly one creator wins.

A namespace marker (`_sparkqueue.json` at the root) is written once the catalog exists, so a
catalog whose log was deleted or emptied is reported as damaged instead of opening an empty
namespace over orphaned entity tables.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Self, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkqueue.errors import EntityNotFoundError, InvalidOperationError, SparkQueueError, StorageCorruptedError, StorageError
from sparkqueue.storage.checkpoint import write_checkpoint
from sparkqueue.storage.files import encode_parquet
from sparkqueue.storage.log import AddFile, CommitConflict, DeltaLog, Fence, RemoveFile, Snapshot, checkpoint_interval
from sparkqueue.storage.retry import Deadline, retry_commit
from sparkqueue.storage.schema import CATALOG_SCHEMA
from sparkqueue.storage.store import Store, delta_rs_errors

T = TypeVar("T")
CATALOG_DIR = "_catalog"
MARKER = "_sparkqueue.json"
FORMAT_VERSION = 1
CATALOG_FENCE = "sparkqueue.catalog"
READ_ATTEMPTS = 5  # reads of ever newer versions before a catalog replaced under each of them is an error


class _Missing(Exception):  # noqa: N818 - a signal between _read_file and _rows, not an error users see
    """A file of the snapshot being read is absent."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog row."""

    name: str
    entity_type: str
    table_path: str
    properties: str
    created_at_utc: datetime
    updated_at_utc: datetime


class _Files:
    """The catalog's live files (a FileSet for log.py): path to add action."""

    def __init__(self) -> None:
        self.adds: dict[str, Mapping[str, Any]] = {}

    def add(self, action: Mapping[str, Any]) -> None:
        self.adds[action["path"]] = action

    def remove(self, path: str) -> None:
        self.adds.pop(path, None)

    def actions(self) -> Iterable[Mapping[str, Any]]:
        return self.adds.values()

    def __contains__(self, path: object) -> bool:
        return path in self.adds

    def __len__(self) -> int:
        return len(self.adds)

    def copy(self) -> Self:
        other = type(self)()
        other.adds = dict(self.adds)
        return other


class Catalog:
    """Create, read, update and delete catalog rows, each a single Delta commit."""

    def __init__(self, root_store: Store, storage_options: Mapping[str, str] | None = None) -> None:
        self.root_store = root_store
        self.store = root_store.child(CATALOG_DIR)
        self.uri = self.store.uri
        self.storage_options = dict(storage_options or {})
        self.log = DeltaLog(self.store, _Files, after_commit=self._after_commit)
        self._lock = threading.RLock()
        self._snap: Snapshot | None = None
        self._read: tuple[int, pa.Table] | None = None  # the rows of the last version read

    def open(self, settings: Mapping[str, str] | None = None, *, create: bool = True) -> dict[str, Any]:
        """Open the catalog, creating it and the namespace marker (recording `settings`) when the namespace is new.

        Returns the marker's contents: the settings of whoever created the namespace. Without
        `create`, a root that holds no namespace raises EntityNotFoundError and nothing is written.
        """
        marker = self._marker()
        try:
            snap = self.log.load()
        except FileNotFoundError:
            if marker is None and not create:
                raise self._no_namespace() from None
            if marker is not None:
                raise StorageCorruptedError(
                    f"namespace {self.root_store.uri}: the catalog log ({self.uri}/_delta_log) is missing or empty, "
                    "but the namespace exists; restore it from a backup (`sparkqueue check` reports what remains)"
                ) from None
            self._create()
            snap = self.log.load()
        if marker is None and len(snap.files):  # entities are recorded under a marker (open writes it first)
            marker = self._marker()  # read again after the log: a concurrent creator may have written both meanwhile
            if marker is None:  # it was lost
                raise StorageCorruptedError(
                    f"namespace {self.root_store.uri}: its marker {MARKER} is missing but its catalog holds entities; "
                    f'restore the marker (it holds {{"format_version": {FORMAT_VERSION}, "tier": "standard"}} or "premium")'
                )
        if marker is None and not create:  # a catalog without marker: a create that died half-way
            raise self._no_namespace()
        if marker is None:
            content = {"format_version": FORMAT_VERSION, **(settings or {})}
            self.root_store.put_if_absent(MARKER, json.dumps(content).encode())
            marker = self._marker() or content  # a concurrent creator's marker wins
        with self._lock:
            self._snap = snap
        return marker

    def _no_namespace(self) -> EntityNotFoundError:
        """The error for a root that holds no namespace."""
        return EntityNotFoundError(
            f"there is no sparkqueue namespace at {self.root_store.uri!r}; check the root, or create one there "
            "(Namespace(root), or `sparkqueue --root ROOT create ...`)"
        )

    def _marker(self) -> dict[str, Any] | None:
        """The namespace marker's contents, None when there is none; a damaged or newer one is refused."""
        try:
            raw = self.root_store.get(MARKER)
        except FileNotFoundError:
            return None
        try:
            marker = json.loads(raw)
        except ValueError:
            marker = None
        if not isinstance(marker, dict) or not isinstance(marker.get("format_version"), int):
            raise StorageCorruptedError(f"namespace {self.root_store.uri}: its marker {MARKER} is damaged")
        if marker["format_version"] > FORMAT_VERSION:
            raise InvalidOperationError(
                f"namespace {self.root_store.uri} has format version {marker['format_version']}; "
                f"this sparkqueue reads up to {FORMAT_VERSION}: upgrade sparkqueue"
            )
        return marker

    def _create(self) -> None:
        """Create the empty catalog table with delta-rs (a concurrent creator may win: then it exists)."""
        from deltalake import DeltaTable

        try:
            with delta_rs_errors(self.uri, "creating the catalog"):
                DeltaTable.create(self.uri, schema=CATALOG_SCHEMA, mode="ignore", storage_options=self.storage_options or None)
        except StorageError:
            if not self.log.exists():
                raise

    def _after_commit(self, snap: Snapshot) -> None:
        """Checkpoint every `delta.checkpointInterval` versions, so opening the namespace stays one read."""
        if snap.version % checkpoint_interval(snap.configuration) == 0:
            write_checkpoint(self.store, snap)

    def _snapshot(self) -> Snapshot:
        with self._lock:
            if self._snap is None:
                self.open()
            assert self._snap is not None
            return self.log.update(self._snap)

    def snapshot(self) -> Snapshot:
        """A private copy of the catalog's newest snapshot (for maintenance: checkpoint and vacuum)."""
        with self._lock:
            return self._snapshot().copy()

    def _rows(self, snap: Snapshot | None = None) -> pa.Table:
        """The whole catalog (it is small), typed as CATALOG_SCHEMA; read again only when its version moved.

        A file of `snap` that a newer commit replaced and a vacuum deleted during the read moves `snap`
        forward in place (_catch_up) and the read starts over, so a change computed from the rows
        commits against the version they were read at.
        """
        with self._lock:
            snap = snap or self._snapshot()
        attempt = 1
        while True:
            with self._lock:
                if self._read is not None and self._read[0] == snap.version:
                    return self._read[1]
                version, paths = snap.version, sorted(snap.files.adds)
            try:
                parts = [self._read_file(p) for p in paths]
            except _Missing as missing:
                self._catch_up(snap, missing.path, attempt)
                attempt += 1
                continue
            rows = pa.concat_tables(parts) if parts else CATALOG_SCHEMA.empty_table()
            with self._lock:
                self._read = (version, rows)
            return rows

    def _catch_up(self, snap: Snapshot, path: str, attempt: int) -> None:
        """Move `snap` to the newest version after its file `path` was found missing; StorageCorruptedError if still live there.

        Vacuum at a short retention deletes a file once a newer commit replaced it, while a reader of
        the older version may be about to read it (docs/storage.md): no damage, the newer version is
        read instead. Only a file live at the newest version is damage. A catalog replaced under
        READ_ATTEMPTS reads in a row raises StorageError (retry), so a read cannot loop forever.
        """
        with self._lock:
            try:
                live = path in self.log.update(snap).files
            except StorageCorruptedError:
                raise
            except (SparkQueueError, OSError) as exc:  # the log cannot be read now: that tells nothing of damage
                raise StorageError(
                    f"namespace catalog {self.uri}: file {path} was not found, and reading the log to tell why failed "
                    f"({exc}); retry"
                ) from exc
        if live:
            raise StorageCorruptedError(f"namespace catalog {self.uri}: live file {path} is missing")
        if attempt >= READ_ATTEMPTS:
            raise StorageError(
                f"namespace catalog {self.uri}: its file was replaced and vacuumed under {attempt} reads in a row; "
                "retry, or vacuum with a longer retention"
            )

    def _read_file(self, path: str) -> pa.Table:
        """The rows of one live catalog file; StorageCorruptedError naming catalog and file if unreadable, _Missing if absent.

        A catalog read as empty would open an empty namespace over orphaned entity tables: a truncated,
        zeroed or foreign file is damage, never "no entities". A missing one may have been replaced (_catch_up).
        """
        try:
            data = self.store.get(path)
        except FileNotFoundError as exc:
            raise _Missing(path) from exc
        try:
            return pq.read_table(pa.BufferReader(data)).select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        except (pa.ArrowException, OSError, KeyError) as exc:  # not Parquet, torn, or not the catalog's columns
            raise StorageCorruptedError(
                f"namespace catalog {self.uri}: live file {path} is damaged ({len(data)} bytes: {exc}); restore it from a backup"
            ) from exc

    def entries(self, entity_type: str | None = None) -> list[CatalogEntry]:
        """All rows (of one entity type when given), sorted by name."""
        t = self._rows()
        if entity_type is not None:
            t = t.filter(pc.equal(t.column("entity_type"), entity_type))
        return sorted((CatalogEntry(**r) for r in t.to_pylist()), key=lambda e: e.name)

    def get(self, key: str) -> CatalogEntry | None:
        """The row of a key, or None."""
        t = self._rows()
        rows = t.filter(pc.equal(t.column("name"), key)).to_pylist()
        return CatalogEntry(**rows[0]) if rows else None

    def insert(
        self,
        entries: list[CatalogEntry],
        deadline: Deadline,
        same_as: Callable[[str], bool] | None = None,
        require: Callable[[list[CatalogEntry]], None] | None = None,
    ) -> bool:
        """Insert rows in one commit unless the first one's key exists, or a key `same_as` accepts; True when inserted.

        Both are checked against the rows the commit replaces, so two racing inserts never both land.
        `require` sees those rows too and raises to refuse the insert (a parent that must exist, a
        quota), so a rule checked there holds against every concurrent change of the catalog.
        """
        src = pa.Table.from_pylist([e.__dict__ for e in entries], schema=CATALOG_SCHEMA)

        def change(rows: pa.Table) -> tuple[pa.Table | None, bool]:
            if pc.any(pc.equal(rows.column("name"), entries[0].name)).as_py():
                return None, False
            if same_as is not None and any(same_as(key) for key in rows.column("name").to_pylist()):
                return None, False
            if require is not None:
                require([CatalogEntry(**r) for r in rows.to_pylist()])
            return pa.concat_tables([rows, src]), True

        return self._change(change, deadline, f"create {entries[0].name}")

    def update(self, key: str, properties: str, deadline: Deadline, table_path: str | None = None) -> bool:
        """Replace the settings of a key; False when it does not exist (or, with `table_path`, no longer names that table)."""

        def change(rows: pa.Table) -> tuple[pa.Table | None, bool]:
            hit = pc.equal(rows.column("name"), key)
            if table_path is not None:
                hit = pc.and_(hit, pc.equal(rows.column("table_path"), table_path))
            if not pc.any(hit).as_py():
                return None, False
            now = pa.scalar(datetime.now(UTC), CATALOG_SCHEMA.field("updated_at_utc").type)
            rows = rows.set_column(
                rows.schema.get_field_index("properties"), "properties", pc.if_else(hit, properties, rows.column("properties"))
            )
            rows = rows.set_column(
                rows.schema.get_field_index("updated_at_utc"),
                "updated_at_utc",
                pc.if_else(hit, now, rows.column("updated_at_utc")),
            )
            return rows.cast(CATALOG_SCHEMA), True

        return self._change(change, deadline, f"update {key}")

    def delete(
        self,
        keys: list[str],
        deadline: Deadline,
        children: Callable[[str], bool] | None = None,
        table_path: str | None = None,
    ) -> int:
        """Delete keys, and the keys `children` accepts when one of them exists, in one commit; how many of `keys` went.

        The children are found in the rows the commit replaces, so one created concurrently goes too.
        With `table_path`, a key goes only while it still names that table: an entity deleted and
        created again meanwhile is another one, and stays.
        """

        def change(rows: pa.Table) -> tuple[pa.Table | None, int]:
            hit = pc.is_in(rows.column("name"), value_set=pa.array(keys, pa.string()))
            if table_path is not None:
                hit = pc.and_(hit, pc.equal(rows.column("table_path"), table_path))
            n = pc.sum(hit).as_py() or 0
            if not n:
                return None, 0
            if children is not None:
                hit = pc.or_(hit, pa.array([children(k) for k in rows.column("name").to_pylist()], pa.bool_()))
            return rows.filter(pc.invert(hit)), n

        return self._change(change, deadline, f"delete {keys[0]}")

    def _change(self, change: Callable[[pa.Table], tuple[pa.Table | None, T]], deadline: Deadline, what: str) -> T:
        """Apply `change` to the current rows and commit the result as the catalog's one file; retried on conflicts."""

        def attempt() -> T:
            with self._lock:
                snap = self._snapshot().copy()
            rows, result = change(self._rows(snap))
            if rows is None:
                return result
            data = encode_parquet(rows)
            path = f"part-{uuid.uuid4().hex}.parquet"
            self.store.put(path, data)
            old = [RemoveFile(p, {}, int(a.get("size", 0))) for p, a in snap.files.adds.items()]
            # Every change moves one fence, so two concurrent changes always conflict (even on an empty catalog).
            fence = Fence(CATALOG_FENCE, (snap.transaction_version(CATALOG_FENCE) or 0) + 1)
            try:
                self.log.commit(snap, [AddFile(path, {}, len(data), _stats(rows))], old, [fence], operation="WRITE")
            except CommitConflict:  # after any other error the commit may have landed: the file stays
                self.store.delete(path)
                raise
            return result

        return retry_commit(attempt, deadline, what)


def _stats(rows: pa.Table) -> str:
    return json.dumps({"numRecords": rows.num_rows})
