"""The namespace: client and administration client in one (SDK: ServiceBusClient + ServiceBusAdministrationClient)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sparkqueue.constants import ReceiveMode, SubQueue
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    InvalidOperationError,
    PartitionUnavailableError,
    QuotaExceededError,
)
from sparkqueue.model import limits
from sparkqueue.model.entity import Entity
from sparkqueue.model.properties import (
    QueueProperties,
    RuntimeProperties,
    _EntityProperties,
    build_properties,
    check_update,
)
from sparkqueue.model.sessions import SessionInfo, Sessions
from sparkqueue.receiver import Receiver
from sparkqueue.sender import Sender
from sparkqueue.storage.catalog import Catalog, CatalogEntry, catalog_key
from sparkqueue.storage.faults import FaultInjector
from sparkqueue.storage.retry import Deadline
from sparkqueue.storage.table import EntityTable
from sparkqueue.transaction import Transaction

log = logging.getLogger(__name__)

QUEUE = "queue"
PROPERTIES_TTL_S = 1.0  # how long a process trusts cached entity settings before re-reading the catalog
_PROPERTY_TYPES: dict[str, type[_EntityProperties]] = {QUEUE: QueueProperties}


@dataclass
class _Cached:
    entity: Entity
    table_path: str
    loaded_at: float


class Namespace:
    """A root location holding a catalog and one Delta table per entity; opened (and created) by path or URI."""

    def __init__(self, root: str | os.PathLike[str], tier: str = limits.STANDARD, *, operation_timeout: float = 60.0) -> None:
        self.root = str(root).rstrip("/")
        self.tier = limits.check_tier(tier)
        if isinstance(operation_timeout, bool) or not isinstance(operation_timeout, (int, float)) or operation_timeout <= 0:
            raise InvalidOperationError(f"operation_timeout must be a positive number of seconds, got {operation_timeout!r}")
        self.operation_timeout = float(operation_timeout)
        if "://" not in self.root:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        self._catalog = Catalog(f"{self.root}/_catalog")
        self._catalog.open()
        self._cache: dict[str, _Cached] = {}
        self._faults: dict[str, FaultInjector] = {}
        self._lock = threading.RLock()
        self._local = threading.local()

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop cached table handles; the namespace may be entered again afterwards."""
        with self._lock:
            self._cache.clear()

    def __repr__(self) -> str:
        return f"Namespace({self.root!r}, tier={self.tier!r})"

    # ---- faults (tests and drills) ---------------------------------------------------------------

    def fault_injector(self, entity_name: str, entity_type: str = QUEUE) -> FaultInjector:
        """The fault hook of an entity's table in this process: make partitions fail reads or writes."""
        with self._lock:
            return self._faults.setdefault(catalog_key(entity_type, entity_name), FaultInjector())

    # ---- entity resolution ---------------------------------------------------------------------

    def _deadline(self) -> Deadline:
        return Deadline(self.operation_timeout)

    def _entry(self, entity_type: str, name: str) -> CatalogEntry:
        entry = self._catalog.get(catalog_key(entity_type, name))
        if entry is None:
            raise EntityNotFoundError(f"{entity_type} {name!r} does not exist in namespace {self.root!r}")
        return entry

    def _entity(self, entity_type: str, name: str) -> Entity:
        """The entity with settings at most PROPERTIES_TTL_S old; raises EntityNotFoundError."""
        key = catalog_key(entity_type, name)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and time.monotonic() - cached.loaded_at < PROPERTIES_TTL_S:
                return cached.entity
        entry = self._entry(entity_type, name)
        props = _PROPERTY_TYPES[entity_type].from_json(entry.properties)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.table_path == entry.table_path:
                cached.entity.props = props
                cached.loaded_at = time.monotonic()
                return cached.entity
            table = EntityTable(entry.table_path, props.partition_count, self.fault_injector(name, entity_type))
            entity = Entity(props, table, self.operation_timeout)
            self._cache[key] = _Cached(entity, entry.table_path, time.monotonic())
            return entity

    def _props(self, entity_type: str, name: str) -> _EntityProperties:
        return self._entity(entity_type, name).props

    # ---- management ----------------------------------------------------------------------------

    def _create(self, entity_type: str, name: str, settings: dict[str, Any]) -> _EntityProperties:
        props = build_properties(_PROPERTY_TYPES[entity_type], name, self.tier, settings)
        self._check_entity_quota(props)
        table_path = f"{self.root}/entities/{entity_type}-{uuid.uuid4().hex}"
        EntityTable.create(table_path)
        now = datetime.now(UTC)
        entry = CatalogEntry(catalog_key(entity_type, name), entity_type, table_path, props.to_json(), now, now)
        if not self._catalog.insert(entry, self._deadline()):
            _remove_table(table_path)
            raise EntityAlreadyExistsError(f"{entity_type} {name!r} already exists in namespace {self.root!r}")
        log.info("created %s %s (%d partitions)", entity_type, name, props.partition_count)
        return props

    def _check_entity_quota(self, props: _EntityProperties) -> None:
        entries = self._catalog.entries()
        if len(entries) >= limits.MAX_ENTITIES:
            raise QuotaExceededError(f"the namespace already holds {limits.MAX_ENTITIES} entities")
        if props.partition_count > 1 and props.entity_type != "subscription":
            partitioned = sum(
                1 for e in entries if e.entity_type != "subscription" and '"enable_partitioning": true' in e.properties
            )
            if partitioned >= limits.MAX_PARTITIONED_ENTITIES:
                raise QuotaExceededError(
                    f"the namespace already holds {limits.MAX_PARTITIONED_ENTITIES} partitioned queues and topics; "
                    "create this one with enable_partitioning=False or delete one"
                )

    def _require_all_partitions(self, entity: Entity, what: str) -> None:
        down = [p for p in range(entity.partition_count) if not entity.available(p)]
        if down:
            raise PartitionUnavailableError(
                f"cannot {what}: partition(s) {down} of {entity.name!r} are unavailable; nothing was changed"
            )

    def _update(self, entity_type: str, props: _EntityProperties) -> None:
        if not isinstance(props, _PROPERTY_TYPES[entity_type]):
            raise InvalidOperationError(
                f"update_{entity_type} needs {_PROPERTY_TYPES[entity_type].__name__}, got {type(props).__name__}"
            )
        entity = self._entity(entity_type, props.name)
        check_update(_PROPERTY_TYPES[entity_type].from_json(self._entry(entity_type, props.name).properties), props, self.tier)
        self._require_all_partitions(entity, f"update {entity_type} {props.name!r}")
        if not self._catalog.update(catalog_key(entity_type, props.name), props.to_json(), self._deadline()):
            raise EntityNotFoundError(f"{entity_type} {props.name!r} does not exist")
        with self._lock:
            self._cache.pop(catalog_key(entity_type, props.name), None)

    def _delete(self, entity_type: str, name: str) -> None:
        entity = self._entity(entity_type, name)
        self._require_all_partitions(entity, f"delete {entity_type} {name!r}")
        entry = self._entry(entity_type, name)
        if self._catalog.delete([entry.name], self._deadline()) == 0:
            raise EntityNotFoundError(f"{entity_type} {name!r} does not exist")
        with self._lock:
            self._cache.pop(entry.name, None)
        _remove_table(entry.table_path)
        log.info("deleted %s %s", entity_type, name)

    def _list(self, entity_type: str) -> list[_EntityProperties]:
        cls = _PROPERTY_TYPES[entity_type]
        return [cls.from_json(e.properties) for e in self._catalog.entries(entity_type)]

    def _runtime(self, entity_type: str, name: str) -> RuntimeProperties:
        entry = self._entry(entity_type, name)
        rp = self._entity(entity_type, name).runtime_properties()
        rp.name, rp.created_at_utc, rp.updated_at_utc = name, entry.created_at_utc, entry.updated_at_utc
        return rp

    # queues

    def create_queue(self, queue_name: str, **settings: Any) -> QueueProperties:
        """Create a queue; settings are the SDK's keyword names (enable_partitioning, lock_duration, ...)."""
        props = self._create(QUEUE, limits.check_entity_name(queue_name), settings)
        assert isinstance(props, QueueProperties)
        return props

    def get_queue(self, queue_name: str) -> QueueProperties:
        """The queue's settings."""
        props = QueueProperties.from_json(self._entry(QUEUE, queue_name).properties)
        assert isinstance(props, QueueProperties)
        return props

    def update_queue(self, queue: QueueProperties) -> None:
        """Apply changed settings (partitioning and sessions are fixed at creation)."""
        self._update(QUEUE, queue)

    def delete_queue(self, queue_name: str) -> None:
        """Delete the queue and all its messages."""
        self._delete(QUEUE, queue_name)

    def list_queues(self) -> list[QueueProperties]:
        """All queues, by name."""
        return self._list(QUEUE)  # type: ignore[return-value]

    def get_queue_runtime_properties(self, queue_name: str) -> RuntimeProperties:
        """Message counts and size, aggregated over partitions, with the per-partition breakdown."""
        return self._runtime(QUEUE, queue_name)

    def get_queue_sender(self, queue_name: str) -> Sender:
        """A sender to the queue."""
        return Sender(self, QUEUE, queue_name)

    def get_queue_receiver(
        self,
        queue_name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        session_id: Any = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
    ) -> Receiver:
        """A receiver of the queue, of its dead-letter sub-queue, or (session_id) of one of its sessions."""
        return Receiver(
            self,
            QUEUE,
            queue_name,
            receive_mode=receive_mode,
            sub_queue=sub_queue,
            prefetch_count=prefetch_count,
            max_wait_time=max_wait_time,
            session_id=session_id,
        )

    # ---- transactions and sessions ------------------------------------------------------------

    def transaction(self) -> Transaction:
        """`with ns.transaction() as tx:` groups sends and settlements on one entity into one atomic commit."""
        return Transaction(self)

    def list_queue_sessions(self, queue_name: str) -> list[SessionInfo]:
        """Sessions of a session-enabled queue, with their state, lock expiry and message counts."""
        return Sessions(self._entity(QUEUE, queue_name)).list()

    # ---- data path used by senders ---------------------------------------------------------------

    @property
    def _active_transaction(self) -> Any:
        return getattr(self._local, "transaction", None)

    def _targets(self, entity_type: str, name: str) -> list[Entity]:
        """The entity tables a sender's operation lands in."""
        return [self._entity(entity_type, name)]


def _remove_table(path: str) -> None:
    """Delete an entity table's files (local namespaces; object stores keep them for maintenance)."""
    if "://" in path and not path.startswith("file://"):
        log.warning("leaving %s in place: remove it with your object store's lifecycle rules", path)
        return
    import shutil

    shutil.rmtree(path.removeprefix("file://"), ignore_errors=True)
