"""The namespace catalog: one small Delta table mapping entity names to their tables and settings.

Creation is a MERGE that inserts only when the name is absent. Two concurrent creators both
read the catalog, so the second commit fails, retries on the new snapshot, and inserts nothing:
exactly one wins.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from sparkqueue.storage.retry import Deadline, retry_commit
from sparkqueue.storage.schema import CATALOG_SCHEMA


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog row."""

    name: str
    entity_type: str
    table_path: str
    properties: str
    created_at_utc: datetime
    updated_at_utc: datetime


def catalog_key(entity_type: str, name: str) -> str:
    """Catalog key: entity type and name, so a queue and a topic may share a name as in Service Bus."""
    return f"{entity_type}:{name}"


class Catalog:
    """Create, read, update and delete catalog rows, each a single Delta commit."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._lock = threading.RLock()
        self._dt: DeltaTable | None = None
        self._read: tuple[int, pa.Table] | None = None  # the rows of the last version read

    def open(self) -> None:
        """Open the catalog table, creating it when the namespace is new (a concurrent creator may win)."""
        try:
            self._dt = DeltaTable(self.uri)
        except TableNotFoundError:
            with contextlib.suppress(Exception):
                DeltaTable.create(self.uri, schema=CATALOG_SCHEMA, mode="ignore")
            self._dt = DeltaTable(self.uri)

    def _snapshot(self) -> DeltaTable:
        with self._lock:
            if self._dt is None:
                self.open()
            else:
                self._dt.update_incremental()
            assert self._dt is not None
            return self._dt

    def _rows(self, dt: DeltaTable | None = None) -> pa.Table:
        """The whole catalog (it is small), typed as CATALOG_SCHEMA; read again only when its version moved."""
        dt = dt or self._snapshot()
        version = dt.version()
        with self._lock:
            if self._read is not None and self._read[0] == version:
                return self._read[1]
        rows = dt.to_pyarrow_table().select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        with self._lock:
            self._read = (version, rows)
        return rows

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

    def insert(self, entries: list[CatalogEntry], deadline: Deadline) -> bool:
        """Insert rows in one commit unless the first one's key exists; True when this call inserted them."""
        src = pa.Table.from_pylist([e.__dict__ for e in entries], schema=CATALOG_SCHEMA)

        def attempt() -> bool:
            dt = self._snapshot()
            rows = self._rows(dt)
            if pc.any(pc.equal(rows.column("name"), entries[0].name)).as_py():
                return False
            dt.merge(src, "t.name = s.name", source_alias="s", target_alias="t").when_not_matched_insert_all().execute()
            return True

        return retry_commit(attempt, deadline, f"create {entries[0].name}")

    def update(self, key: str, properties: str, deadline: Deadline) -> bool:
        """Replace the settings of a key; False when it does not exist."""
        src = pa.table(
            {
                "name": [key],
                "properties": [properties],
                "updated_at_utc": pa.array([datetime.now(UTC)], CATALOG_SCHEMA.field("updated_at_utc").type),
            }
        )

        def attempt() -> bool:
            m = (
                self._snapshot()
                .merge(src, "t.name = s.name", source_alias="s", target_alias="t")
                .when_matched_update({"properties": "s.properties", "updated_at_utc": "s.updated_at_utc"})
                .execute()
            )
            return m["num_target_rows_updated"] == 1

        return retry_commit(attempt, deadline, f"update {key}")

    def delete(self, keys: list[str], deadline: Deadline) -> int:
        """Delete keys in one commit; the number deleted."""
        src = pa.table({"name": pa.array(keys, pa.string())})

        def attempt() -> int:
            m = self._snapshot().merge(src, "t.name = s.name", source_alias="s", target_alias="t").when_matched_delete().execute()
            return int(m["num_target_rows_deleted"])

        return retry_commit(attempt, deadline, f"delete {keys[0]}")
