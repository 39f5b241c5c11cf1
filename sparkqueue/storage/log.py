"""The Delta transaction log, read and written by sparkqueue itself: snapshots and optimistic commits.

A `Snapshot` is a table's state at one version: protocol, metadata, live files (kept by a
`FileSet` the caller chooses, e.g. the entity file index) and `txn` versions (the partition
fences). It is loaded once from the newest checkpoint plus the JSON entries after it, then moved
forward by reading only the new `_delta_log/<version>.json` entries.

A commit writes the next version's JSON with put-if-absent. When another writer took that
version first, the snapshot replays the winners, and the commit is retried on top of them if
they removed none of the files it removes, moved none of the fences it read and changed no
metadata or protocol; otherwise `CommitConflict` tells the caller to recompute. See
docs/storage.md for the format and the reasoning.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import pyarrow as pa
import pyarrow.parquet as pq

from sparkqueue.errors import EntityNotFoundError, StorageCorruptedError, StorageError
from sparkqueue.storage.store import Entry, Store

log = logging.getLogger(__name__)

LOG_DIR = "_delta_log"
CLIENT_VERSION = "sparkqueue"
MAX_REBASES = 256
LOAD_ATTEMPTS = 4
# Written at a table's root before its files are deleted, removed last: a commit landing meanwhile withdraws itself
# (without it, such a commit's entry outlived the delete and the next stale commit found its predecessor there).
TOMBSTONE = "_sparkqueue_deleting"
MAX_UNLISTED = 8  # entries a listing left out that a load looks up by name before it reports a gap
_ENTRY = re.compile(r"^(\d{20})\.(json|checkpoint\.parquet|checkpoint\.(\d+)\.(\d+)\.parquet)$")
# What sparkqueue writes correctly: plain Parquet files with add/remove/txn actions, no deletion
# vectors, no column mapping, no change data feed, no row tracking.
WRITABLE_READER_FEATURES = frozenset({"timestampNtz"})
WRITABLE_WRITER_FEATURES = frozenset({"timestampNtz", "invariants", "appendOnly", "checkConstraints"})
# What sparkqueue reads correctly: reader version 1, 2 without column mapping (checked on the
# metadata), or 3 with only these reader features. A feature that changes how files are read
# (deletionVectors, columnMapping, v2Checkpoint, typeWidening, variantType, any unknown one) is refused.
READABLE_READER_FEATURES = frozenset({"timestampNtz"})


DEFAULT_LOG_RETENTION_S = 30 * 86400.0  # Delta's default logRetentionDuration
ACTION_COUNT = "sparkqueueActions"  # commitInfo field: the actions of the entry, commitInfo included (entry_actions)
# Txn app ids under this prefix are short-lived idempotence marks (forwarding's): a checkpoint drops one
# not updated for MARK_RETENTION_MS. Every other txn (partition fences, stream sinks) is kept for good
# (docs/storage.md, "Idempotent appends").
MARK_PREFIX = "sparkqueue.fwd."
MARK_RETENTION_MS = 7 * 86400 * 1000
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+(\w+?)s?\s*$", re.IGNORECASE)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}


def log_retention_s(configuration: Mapping[str, str]) -> float:
    """The table's delta.logRetentionDuration in seconds ("interval <n> <unit>"; Delta's default when unset)."""
    return _interval_s(configuration.get("delta.logRetentionDuration") or "")


@functools.lru_cache(maxsize=16)
def _interval_s(text: str) -> float:
    """A Delta interval setting in seconds (every commit asks: parsed once per distinct value)."""
    m = _INTERVAL.match(text)
    if m is None or m.group(2).lower() not in _UNIT_S:
        return DEFAULT_LOG_RETENTION_S
    return int(m.group(1)) * _UNIT_S[m.group(2).lower()]


def checkpoint_interval(configuration: Mapping[str, str]) -> int:
    """The table's delta.checkpointInterval (Delta's default 100)."""
    try:
        return max(1, int(configuration.get("delta.checkpointInterval", "100")))
    except ValueError:
        return 100


class CommitConflict(Exception):  # noqa: N818 - a signal between layers, not an error users see
    """A concurrent commit changed what this commit was computed from: recompute on a fresh snapshot."""


class _Trimmed(Exception):  # noqa: N818
    """A listed log entry vanished while loading: a trimmer removed it after a newer checkpoint."""


class _Gap(Exception):  # noqa: N818
    """The listing skipped entries below its newest one: missing, or committed while the directory was read.

    A directory listing need not show the files created while it runs (a local disk lists in hash
    order), so v+1 can be listed without v; only a gap that a fresh listing still shows is damage.
    """


@dataclass(frozen=True)
class Fence:
    """A Delta `txn` action: application id and version (a partition's sequence counter, an idempotence key)."""

    app_id: str
    version: int


@dataclass(frozen=True)
class AddFile:
    """A data file to add: path relative to the table, partition values, size and Delta statistics (JSON)."""

    path: str
    partition_values: Mapping[str, str]
    size: int
    stats: str

    def action(self, now_ms: int) -> dict[str, Any]:
        """The `add` action as the log stores it."""
        return {
            "path": self.path,
            "partitionValues": dict(self.partition_values),
            "size": self.size,
            "modificationTime": now_ms,
            "dataChange": True,
            "stats": self.stats,
        }


@dataclass(frozen=True)
class RemoveFile:
    """A live data file to remove."""

    path: str
    partition_values: Mapping[str, str]
    size: int

    def action(self, now_ms: int) -> dict[str, Any]:
        """The `remove` action as the log stores it."""
        return {
            "path": self.path,
            "deletionTimestamp": now_ms,
            "dataChange": True,
            "extendedFileMetadata": True,
            "partitionValues": dict(self.partition_values),
            "size": self.size,
        }


class FileSet(Protocol):
    """What a snapshot keeps of its live files; the entity file index is one."""

    def add(self, action: Mapping[str, Any]) -> None: ...
    def remove(self, path: str) -> None: ...
    def actions(self) -> Iterable[Mapping[str, Any]]: ...
    def __contains__(self, path: object) -> bool: ...
    def __len__(self) -> int: ...
    def copy(self) -> Self: ...


@dataclass
class Snapshot:
    """A table at one version. `verified_at` is when the log was last seen to have no newer entry."""

    version: int
    protocol: dict[str, Any]
    metadata: dict[str, Any]
    files: Any  # a FileSet
    txns: dict[str, int] = field(default_factory=dict)
    verified_at: float = 0.0
    metadata_version: int = 0  # the version that last changed metadata or protocol
    txn_times: dict[str, int] = field(default_factory=dict)  # each txn's lastUpdated (ms), where the log gave one

    def transaction_version(self, app_id: str) -> int | None:
        """The version recorded for a `txn` application id, or None."""
        return self.txns.get(app_id)

    @property
    def configuration(self) -> dict[str, str]:
        """The table's configuration (delta.* settings)."""
        return dict(self.metadata.get("configuration") or {})

    def copy(self) -> Snapshot:
        """An independent snapshot at the same version (files are immutable, so sharing their descriptions is safe)."""
        return Snapshot(
            self.version,
            self.protocol,
            self.metadata,
            self.files.copy(),
            dict(self.txns),
            self.verified_at,
            self.metadata_version,
            dict(self.txn_times),
        )

    def apply(self, version: int, actions: Iterable[Mapping[str, Any]]) -> None:
        """Move to `version` by applying one commit's actions."""
        for action in actions:
            if "add" in action:
                self.files.add(action["add"])
            elif "remove" in action:
                self.files.remove(_unquote(action["remove"]["path"]))
            elif "txn" in action:
                txn = action["txn"]
                self.txns[txn["appId"]] = int(txn["version"])
                if txn.get("lastUpdated") is not None:
                    self.txn_times[txn["appId"]] = int(txn["lastUpdated"])
            elif "metaData" in action:
                self.metadata = action["metaData"]
                self.metadata_version = version
            elif "protocol" in action:
                self.protocol = action["protocol"]
                self.metadata_version = version
        self.version = version


class DeltaLog:
    """Reads and writes one table's `_delta_log` through a store rooted at the table."""

    def __init__(
        self, store: Store, new_files: Callable[[], Any], after_commit: Callable[[Snapshot], None] | None = None
    ) -> None:
        """`new_files` makes an empty FileSet; `after_commit` runs after each successful commit (checkpoints)."""
        self.store = store
        self.new_files = new_files
        self.after_commit = after_commit

    @staticmethod
    def safe_gap_s(snap: Snapshot) -> float:
        """How long a snapshot may go without seeing the log's head before it must be reloaded.

        Entries before a checkpoint are trimmed once older than the log retention. A snapshot that
        last saw version v as the newest may commit v+1 by put-if-absent only while v+1, if another
        writer made it since, cannot have been trimmed yet: well within the retention.
        """
        return log_retention_s(snap.configuration) / 4

    # ---- reading --------------------------------------------------------------------------------

    def exists(self) -> bool:
        """True when the table has any log entry or checkpoint (other files there, such as vacuum's record, do not count)."""
        return any(True for _ in _log_files(self.store))

    def load(self) -> Snapshot:
        """The newest snapshot: newest complete checkpoint plus the JSON entries after it.

        Raises FileNotFoundError when there is no log at all, StorageCorruptedError when entries
        are missing between the checkpoint and the newest entry or an entry cannot be read.
        A listed entry that a concurrent trimmer deleted (a newer checkpoint exists), or a gap in one
        listing, means listing again.
        """
        for attempt in range(LOAD_ATTEMPTS - 1):
            try:
                return self._load()
            except (_Trimmed, _Gap):
                time.sleep(0.005 * 2**attempt)  # a writer or trimmer is at work: list again a moment later
        try:
            return self._load()
        except _Gap as gap:
            raise StorageCorruptedError(str(gap)) from None
        except _Trimmed:
            raise StorageError(f"table {self.store.uri}: a log trim raced {LOAD_ATTEMPTS} loads in a row; try again") from None

    def _load(self) -> Snapshot:
        started = time.monotonic()
        jsons: set[int] = set()
        parts: dict[int, dict[int, str]] = {}
        totals: dict[int, int] = {}
        for e, m in _log_files(self.store):
            v = int(m.group(1))
            if m.group(2) == "json":
                jsons.add(v)
            elif m.group(3) is None:
                parts.setdefault(v, {})[1] = e.path
                totals[v] = 1
            else:
                parts.setdefault(v, {})[int(m.group(3))] = e.path
                totals[v] = int(m.group(4))
        complete = [v for v, p in parts.items() if len(p) == totals[v]]
        if not jsons and not complete:
            raise FileNotFoundError(f"{self.store.uri}/{LOG_DIR}")
        newest = max(jsons | set(complete))
        base = max((v for v in complete if v <= newest), default=-1)
        missing = [v for v in range(base + 1, newest + 1) if v not in jsons]
        # A listing taken while entries are being written can skip some: ask for a few by name before calling it a gap.
        missing = missing if len(missing) > MAX_UNLISTED else [v for v in missing if not self.store.exists(_entry_path(v))]
        if missing:
            raise _Gap(
                f"table {self.store.uri}: log entries {_ranges(missing)} are missing "
                f"(checkpoint {base if base >= 0 else 'none'}, newest entry {newest})"
            )
        try:
            snap = self._checkpoint(base, [parts[base][i] for i in sorted(parts[base])]) if base >= 0 else self._empty()
            for v in range(base + 1, newest + 1):
                snap.apply(v, self._readable(self._entry(v), v))
        except FileNotFoundError as exc:
            raise _Trimmed from exc
        snap.verified_at = started
        self._check_readable(snap)
        return snap

    def update(self, snap: Snapshot) -> Snapshot:
        """Move `snap` to the newest version in place (reading only new entries), or reload it when it is too old to trust.

        The first absent entry v is the end of the log only when v+1 is absent too. An entry
        after an absent one means v and v+1 landed between the two reads (v reads now), or v went
        missing (damage): then a reload from a listing raises the StorageCorruptedError a fresh
        load raises for the gap. Without this a live handle read the table as of v-1 and its next
        commit took version v by put-if-absent, forking the history under the entries after it.
        Unreadable actions raise before they are applied, so `snap` stays where it was and every
        later update raises again.
        """
        started = time.monotonic()
        if started - snap.verified_at > self.safe_gap_s(snap):
            return self._reload(snap)
        v = snap.version + 1
        while True:
            try:
                actions = self._entry(v)
            except FileNotFoundError:
                if not self.store.exists(_entry_path(v + 1)):
                    break
                try:  # usually v and v+1 landed between the reads; a reload costs a listing and the checkpoint
                    actions = self._entry(v)
                except FileNotFoundError:
                    return self._reload(snap)
            snap.apply(v, self._readable(actions, v))
            v += 1
        snap.verified_at = started
        return snap

    def _reload(self, snap: Snapshot) -> Snapshot:
        """Replace `snap` in place by a snapshot loaded from a listing.

        A checkpoint does not say which version last changed the metadata, so unchanged metadata
        and protocol keep the version `snap` knew: a commit computed before the reload is not
        refused as if they had changed.
        """
        fresh = self.load()
        same = _set_fields(fresh.metadata) == _set_fields(snap.metadata)
        if same and _set_fields(fresh.protocol) == _set_fields(snap.protocol):
            fresh.metadata_version = snap.metadata_version
        snap.__dict__.update(fresh.__dict__)
        return snap

    def _entry(self, version: int) -> list[dict[str, Any]]:
        """The actions of one JSON entry; FileNotFoundError when absent, StorageCorruptedError when unreadable."""
        path = _entry_path(version)
        try:
            return entry_actions(self.store.get(path))
        except ValueError as exc:
            raise StorageCorruptedError(f"table {self.store.uri}: log entry {path} {exc}") from exc

    def _empty(self) -> Snapshot:
        return Snapshot(-1, {}, {}, self.new_files())

    def _checkpoint(self, version: int, paths: Sequence[str]) -> Snapshot:
        """A snapshot from a (possibly multi-part) checkpoint's add, txn, metaData and protocol actions."""
        snap = self._empty()
        actions: list[dict[str, Any]] = []
        for path in paths:
            try:
                t = pq.read_table(pa.BufferReader(self.store.get(path)))
            except (pa.ArrowInvalid, OSError) as exc:
                raise StorageCorruptedError(f"table {self.store.uri}: checkpoint {path} cannot be read ({exc})") from exc
            for name in ("protocol", "metaData", "txn", "add"):
                if name not in t.column_names:
                    continue
                for row in t.column(name).to_pylist():
                    if row is not None:
                        actions.append({name: _checkpoint_action(name, row)})
        snap.apply(version, self._readable(actions, version))
        return snap

    def _check_readable(self, snap: Snapshot) -> None:
        if not snap.protocol or not snap.metadata:
            raise StorageCorruptedError(f"table {self.store.uri}: the log has no protocol or metadata action")

    def _readable(self, actions: list[dict[str, Any]], version: int) -> list[dict[str, Any]]:
        """`actions` when sparkqueue reads what they describe correctly; StorageError naming the table and feature otherwise.

        A newer writer may upgrade the table at any version: each protocol and metadata action and
        each added file is checked before it is applied, on load (checkpoint and entries) and on update.
        """
        problems: list[str] = []
        deleted = []
        for a in actions:
            if "add" in a:
                if a["add"].get("deletionVector") is not None:
                    deleted.append(a["add"].get("path"))
            elif "protocol" in a:
                problems += _unreadable_protocol(a["protocol"])
            elif "metaData" in a:
                mode = (a["metaData"].get("configuration") or {}).get("delta.columnMapping.mode", "none")
                if mode != "none":
                    problems.append(f"delta.columnMapping.mode={mode}")
        if deleted:
            problems.append(f"{len(deleted)} file(s) with a deletion vector (first {deleted[0]})")
        if problems:
            raise StorageError(
                f"table {self.store.uri} uses Delta features sparkqueue cannot read correctly "
                f"(version {version}): {'; '.join(dict.fromkeys(problems))}"
            )
        return actions

    # ---- writing --------------------------------------------------------------------------------

    def check_writable(self, snap: Snapshot) -> None:
        """Refuse to write a table that uses a Delta feature sparkqueue does not write correctly."""
        p, conf = snap.protocol, snap.configuration
        readers = set(p.get("readerFeatures") or [])
        writers = set(p.get("writerFeatures") or [])
        reader_v, writer_v = int(p.get("minReaderVersion", 1)), int(p.get("minWriterVersion", 2))
        problems = []
        if reader_v > 3 or (reader_v == 2) or not readers <= WRITABLE_READER_FEATURES:
            problems.append(f"reader version {reader_v} with features {sorted(readers)}")
        if writer_v > 7 or writer_v in (4, 5, 6) or not writers <= WRITABLE_WRITER_FEATURES:
            problems.append(f"writer version {writer_v} with features {sorted(writers)}")
        for key in ("delta.enableChangeDataFeed", "delta.enableDeletionVectors", "delta.appendOnly", "delta.enableRowTracking"):
            if str(conf.get(key, "false")).lower() == "true":
                problems.append(f"{key}=true")
        if conf.get("delta.columnMapping.mode", "none") != "none":
            problems.append(f"delta.columnMapping.mode={conf['delta.columnMapping.mode']}")
        if problems:
            raise StorageError(
                f"table {self.store.uri} uses Delta features sparkqueue cannot write correctly: {'; '.join(problems)}"
            )

    def _check_fresh(self, snap: Snapshot) -> None:
        """CommitConflict when `snap` is older than the log's safe window (docs/storage.md, "The safe window")."""
        if time.monotonic() - snap.verified_at > self.safe_gap_s(snap):
            raise CommitConflict("the snapshot is older than the log's safe window; recompute on a fresh one")

    def _after(self, snap: Snapshot) -> None:
        """Housekeeping after a commit landed (checkpoints); its failure is logged, never the commit's."""
        if self.after_commit is None:
            return
        try:
            self.after_commit(snap)
        except Exception as exc:
            log.warning("housekeeping after version %d of %s failed: %s", snap.version, self.store.uri, exc)

    def precheck(self, snap: Snapshot, removed: Sequence[str], seen: Mapping[str, int | None]) -> None:
        """Catch `snap` up and raise CommitConflict now if a commit computed from it could not land.

        Called before a commit's data files are written: a file it removes is gone, a fence it read
        has moved, or the metadata changed. A conflict found here costs no write (the commit checks
        again, over what lands meanwhile).
        """
        base_meta = snap.metadata_version
        self._check_fresh(snap)
        self.update(snap)
        _check_unmoved(snap, base_meta, removed, seen)

    def commit(
        self,
        snap: Snapshot,
        adds: Sequence[AddFile],
        removes: Sequence[RemoveFile],
        fences: Sequence[Fence] = (),
        seen: Mapping[str, int | None] | None = None,
        operation: str = "WRITE",
        ready: Callable[[], None] | None = None,
    ) -> int:
        """Commit actions computed from `snap`; `snap` moves to the new version. Returns it.

        `ready` returns once the added files are durable (or raises): it runs after the entry is
        staged and before it is put, so the entry's write overlaps the files' (docs/storage.md,
        "Committing"). A `ready` that raises leaves nothing committed.

        `seen` holds the fence versions the actions were computed from (default: those in `snap`
        now). Raises CommitConflict, and then only, when the commit did not land: a concurrent
        commit removed a file this one removes, moved one of those fences, or changed metadata or
        protocol. Any other error leaves the outcome unknown, so the caller must not delete the
        commit's files (vacuum removes them if it did not land).
        """
        self.check_writable(snap)
        expected = dict(seen) if seen is not None else {f.app_id: snap.txns.get(f.app_id) for f in fences}
        removed = [r.path for r in removes]
        base_meta = snap.metadata_version
        # The entry names no version, so one entry serves every attempt: a lost race costs no new write.
        actions = _actions(adds, removes, fences, operation, int(time.time() * 1000))
        body = _entry_bytes(actions)
        with self.store.staged(body, LOG_DIR) as put:
            if ready is not None:
                ready()
            for _ in range(MAX_REBASES):
                self._check_fresh(snap)
                _check_unmoved(snap, base_meta, removed, expected)
                version = snap.version + 1
                if put(_entry_path(version)):
                    if self._deleted_under(version):
                        break  # the table was deleted under this handle: withdrawn below, once the staged name is gone
                    self._check_slow_put(snap, version, adds)
                    snap.apply(version, actions)
                    self._after(snap)
                    return version
                log.debug("version %d of %s was taken; rebasing", version, self.store.uri)
                self.update(snap)
            else:
                raise CommitConflict(f"the commit lost {MAX_REBASES} races in a row")
        self._withdraw(version, adds)
        raise TableDeletedError(f"table {self.store.uri} was deleted while in use; nothing was stored")

    def _check_slow_put(self, snap: Snapshot, version: int, adds: Sequence[AddFile]) -> None:
        """After a put that came later than the safe window: what the hold-up may have broken, reported, never acknowledged.

        The window was checked before the put, but a process paused, or a put an object store
        stalled, for longer than the log retention can find version v free because v was trimmed
        behind a checkpoint: every reader starts at that checkpoint and never reads the entry. Or
        only its reply was late, and others read it and checkpointed past it. Unless the second is
        certain (`_read_by_others`), the outcome is unknown: StorageError, never CommitConflict, so
        no caller deletes the files or repeats the commit (a repeat would store it twice, a deletion
        would lose what others read); the entry stays (unread, a trim removes it; read, the log
        needs it), and vacuum removes the files if nothing references them. A hold-up longer than
        vacuum's orphan retention may have let vacuum delete the commit's data files: that raises
        StorageCorruptedError naming them (the entry stands; reads report the partition damaged and
        `check(repair=True)` drops the files) instead of acknowledging what is lost. Only a slow put
        pays the listing and the checks.
        """
        held_s = time.monotonic() - snap.verified_at
        if held_s <= self.safe_gap_s(snap):
            return
        if self._behind_checkpoint(version) and not self._read_by_others(version, adds):
            raise StorageError(
                f"table {self.store.uri}: the outcome of version {version} is unknown: its put or its reply was held "
                f"up {held_s:.0f} s, past the log's safe window, and a checkpoint has passed it since"
            )
        missing = [a.path for a in adds if not self.store.exists(a.path)]
        if missing:
            raise StorageCorruptedError(
                f"table {self.store.uri}: version {version} landed after its put was held up {held_s:.0f} s, and "
                f"{len(missing)} of its data files were vacuumed meanwhile ({missing[0]}); their rows are lost"
            )

    def _read_by_others(self, version: int, adds: Sequence[AddFile]) -> bool:
        """True when the entry at `version` landed in turn and others read it, though its put was acknowledged late.

        Only a slow reply, not a slow put, may have held the commit up: the entry then landed on time,
        others committed on it and a checkpoint folded it in, so it counts as landed. A trim deletes
        entries in version order, so the hole a trim left at `version` has none
        before it; failing that (the entry before was trimmed since), a fresh load that lists one of
        the commit's files as live read the entry too.
        """
        if version > 0 and self.store.exists(_entry_path(version - 1)):
            return True
        mine = {a.path for a in adds}
        return bool(mine) and any(f.path in mine for f in self.load().files)

    def _behind_checkpoint(self, version: int) -> bool:
        """True when the log holds a checkpoint past `version` (one listing): a trimmed v always has one after it.

        A checkpoint at v itself was made by a reader of this very entry, which must then stand.
        """
        return any(m.group(2) != "json" and int(m.group(1)) > version for _, m in _log_files(self.store))

    def _deleted_under(self, version: int) -> bool:
        """True when the table is being deleted (its tombstone), or was (the entry before `version` gone, only it left).

        The commit has landed when this runs: a check that fails (a store hiccup) counts as "not deleted",
        so a landed commit is never reported as failed (its caller would repeat it).
        """
        try:
            if self.store.exists(TOMBSTONE):
                return True
            return version > 0 and not self.store.exists(_entry_path(version - 1)) and self._alone(version)
        except (StorageError, OSError) as exc:
            log.warning("could not check that %s is still live after committing version %d: %s", self.store.uri, version, exc)
            return False

    def _alone(self, version: int) -> bool:
        """True when the entry just written is the log's only one: the table was deleted (the entry before it is gone).

        A log trimmed behind a checkpoint still lists that checkpoint, which is at `version` or later
        (a trim keeps the entries from the newest checkpoint on), so only a deleted table leaves
        nothing else. A checkpoint of an older version proves nothing: a checkpointer that read the
        table before its delete may have written one after it (checkpoint.write_checkpoint then
        removes it again).
        """
        for _, m in _log_files(self.store):
            if int(m.group(1)) == version and m.group(2) == "json":
                continue
            if m.group(2) == "json" or int(m.group(1)) >= version:
                return False
        return True

    def _withdraw(self, version: int, adds: Sequence[AddFile]) -> None:
        """Remove what a commit into a deleted table made again (its files, its entry, the directories): nothing reads them."""
        withdraw(self.store, [*(a.path for a in adds), _entry_path(version)])


def _log_files(store: Store) -> Iterator[tuple[Entry, re.Match[str]]]:
    """The log's entries and checkpoints, each with its name's match (version, kind); not the files of its subfolders
    (_damaged/) nor other files there (temporary files, vacuum's record)."""
    for e in store.list(f"{LOG_DIR}/"):
        folder, _, name = e.path.rpartition("/")
        m = _ENTRY.match(name) if folder == LOG_DIR else None
        if m is not None:
            yield e, m


def withdraw(store: Store, paths: Iterable[str]) -> None:
    """Remove files a writer made in a table deleted under it, then the directories left empty: nothing reads them."""
    for path in paths:
        with contextlib.suppress(OSError, StorageError):
            store.delete(path)
    _remove_empty_dirs(store)


def _remove_empty_dirs(store: Store) -> None:
    """Remove a local table's directories left empty, deepest first (object stores have none)."""
    local = store.local_path("")
    if local is not None:
        for folder, _, _ in sorted(os.walk(local), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def deleted_since(store: Store, version: int) -> bool:
    """True when the table a writer read at `version` was deleted since: its tombstone is there, or its log holds
    neither entry `version` nor any newer file (a trim keeps the entries from the newest checkpoint on)."""
    if store.exists(TOMBSTONE):
        return True
    if store.exists(_entry_path(version)):
        return False
    return not any(int(m.group(1)) > version for _, m in _log_files(store))


def delete_table(store: Store, *, keep_tombstone: bool = True) -> int:
    """Delete a table's files under its tombstone, data first and log last (a half-deleted table reads as deleted).

    Commits landing while the files go find the tombstone and withdraw themselves (DeltaLog.commit).
    The tombstone stays (`keep_tombstone`), alone in the table's folder: a writer whose handle
    predates the delete (a sender's cached table, a checkpointer, a vacuum) finds it and withdraws
    what it wrote, whatever it wrote (without it, stray files of two such writers each passed for
    the other's live table). Maintenance removes the folder once the tombstone is old
    (maintenance.remove_orphan_tables, which passes False). Returns how many files went; a local
    table's emptied directories go too.
    """
    store.put(TOMBSTONE, b"")
    files = [e for e in store.list() if e.path != TOMBSTONE]
    for e in sorted(files, key=lambda e: e.path.startswith(f"{LOG_DIR}/")):
        store.delete(e.path)
    if keep_tombstone:
        _remove_empty_dirs(store)
        return len(files)
    store.delete(TOMBSTONE)
    local = store.local_path("")
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)
    return len(files)


def _set_fields(action: Mapping[str, Any]) -> dict[str, Any]:
    """An action's fields that have a value: a checkpoint stores an absent field as null."""
    return {k: v for k, v in action.items() if v is not None}


def _entry_path(version: int) -> str:
    """Where log entry `version` lives in the table's store."""
    return f"{LOG_DIR}/{version:020d}.json"


class TableDeletedError(EntityNotFoundError):
    """A commit found its table deleted under the handle (its entity was deleted, maybe made again): nothing was stored."""


def _unreadable_protocol(protocol: Mapping[str, Any]) -> list[str]:
    """What in a protocol action sparkqueue cannot read correctly (empty when nothing)."""
    try:
        reader_v = int(protocol.get("minReaderVersion", 1))
    except (TypeError, ValueError):
        return [f"reader version {protocol.get('minReaderVersion')!r}"]
    if reader_v > 3:
        return [f"reader version {reader_v}"]
    if reader_v < 3:
        return []  # 1, or 2 (column mapping, refused on the metadata when a mode is set); features need 3
    unknown = sorted(set(protocol.get("readerFeatures") or []) - READABLE_READER_FEATURES)
    return [f"reader feature {f}" for f in unknown]


def _check_unmoved(snap: Snapshot, base_meta: int, removed: Sequence[str], expected: Mapping[str, int | None]) -> None:
    """CommitConflict when the metadata changed since `base_meta`, a file a commit removes is gone, or a fence it read moved."""
    if snap.metadata_version != base_meta:
        raise CommitConflict("the table's metadata or protocol changed")
    if any(p not in snap.files for p in removed):
        raise CommitConflict("a file this commit removes was removed by another commit")
    if any(snap.txns.get(app) != v for app, v in expected.items()):
        raise CommitConflict("a fence this commit read was moved by another commit")


def entry_actions(data: bytes) -> list[dict[str, Any]]:
    """The actions of one JSON log entry; ValueError saying what is wrong when it is empty, torn or cut short.

    sparkqueue's entries count their actions in their commitInfo (ACTION_COUNT), so an entry cut
    at a line boundary is told from a smaller commit: read as one, its lost lines would silently
    drop messages (adds) or bring completed ones back (removes).
    """
    try:
        actions = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is truncated or not JSON ({exc})") from exc
    if not actions or not all(isinstance(a, dict) for a in actions):
        raise ValueError(f"is empty ({len(data)} bytes)")
    expected = (actions[0].get("commitInfo") or {}).get(ACTION_COUNT)
    if expected is not None and expected != len(actions):
        raise ValueError(f"is cut short: {len(actions)} of its {expected} actions are there")
    return actions


def _actions(
    adds: Sequence[AddFile], removes: Sequence[RemoveFile], fences: Sequence[Fence], operation: str, now_ms: int
) -> list[dict[str, Any]]:
    """The JSON actions of one commit: commitInfo first (counting them all, `entry_actions`), then txn, add and remove."""
    info = {
        "timestamp": now_ms,
        "operation": operation,
        "operationParameters": {},
        "isBlindAppend": not removes,
        "clientVersion": CLIENT_VERSION,
        "txnId": uuid.uuid4().hex,  # unique bytes: a conditional create refused after a lost reply tells its own entry
        ACTION_COUNT: 1 + len(fences) + len(adds) + len(removes),
    }
    out: list[dict[str, Any]] = [{"commitInfo": info}]
    out += [{"txn": {"appId": f.app_id, "version": f.version, "lastUpdated": now_ms}} for f in fences]
    out += [{"add": a.action(now_ms)} for a in adds]
    out += [{"remove": r.action(now_ms)} for r in removes]
    return out


def _entry_bytes(actions: Sequence[Mapping[str, Any]]) -> bytes:
    """A log entry's bytes: one JSON action per line."""
    return "\n".join(json.dumps(a, separators=(",", ":")) for a in actions).encode() + b"\n"


def empty_entry(operation: str, note: str) -> bytes:
    """The bytes of a log entry that changes nothing (commitInfo alone), saying why it was written.

    Repair puts one in place of a damaged entry, so that version stays taken (storage/check.py).
    """
    actions = _actions([], [], [], operation, int(time.time() * 1000))
    actions[0]["commitInfo"]["operationParameters"] = {"note": note}
    return _entry_bytes(actions)


def _checkpoint_action(name: str, row: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint row as the JSON action it stands for (maps arrive from Arrow as lists of pairs)."""
    out = dict(row)
    for key in ("partitionValues", "configuration", "tags"):
        value = out.get(key)
        if isinstance(value, list):
            out[key] = dict(value)
    if name == "metaData" and isinstance(out.get("format"), dict):
        fmt = dict(out["format"])
        if isinstance(fmt.get("options"), list):
            fmt["options"] = dict(fmt["options"])
        out["format"] = fmt
    return out


def _unquote(path: str) -> str:
    from urllib.parse import unquote

    return unquote(path)


def _ranges(versions: Sequence[int]) -> str:
    """`[3, 4, 5, 9]` as '3-5, 9'."""
    out: list[str] = []
    start = prev = versions[0]
    for v in [*versions[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)
