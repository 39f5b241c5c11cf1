"""Write leases: what keeps vacuum away from data files a long write has not committed yet.

Vacuum deletes a file no commit references once it is older than the orphan retention, since
a writer of the engine commits within seconds of writing (docs/storage.md, "Checkpoints,
trimming, vacuum"). A DataFrame send does not: its Spark tasks write files for as long as the
job runs and the driver commits them at its end. Such a writer holds a lease: a small file
`_sparkqueue_leases/<id>` in the table that its process rewrites every LEASE_REFRESH while it
writes, and every file it writes carries `lease-<id>` in its path. Vacuum reads the live leases
(rewritten within LEASE_LIVE) before it reads the snapshot, and keeps every file of a live
lease; a lease its holder stopped refreshing (a killed driver) goes stale, and its files and the
lease file itself are judged by their age again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from types import TracebackType

from sparkqueue.errors import StorageError
from sparkqueue.storage.store import Store

log = logging.getLogger(__name__)

LEASE_DIR = "_sparkqueue_leases"
LEASE_REFRESH_S = 60.0
LEASE_LIVE_S = 600.0  # a lease not rewritten for this long is stale (its holder is gone or stalled)
_ID = re.compile(r"[0-9a-f]{32}")
_LEASED = re.compile(r"lease-([0-9a-f]{32})")


def lease_of(path: str) -> str | None:
    """The id of the lease a file was written under (from its path), or of a lease file itself; None for other files."""
    folder, _, name = path.rpartition("/")
    if folder == LEASE_DIR:
        return name if _ID.fullmatch(name) else None
    m = _LEASED.search(path)
    return m.group(1) if m else None


def live_leases(store: Store, now: float | None = None, within_s: float = LEASE_LIVE_S) -> set[str]:
    """Ids of the table's leases rewritten within `within_s` (store times against `now`, seconds since the epoch)."""
    now = time.time() if now is None else now
    named = ((e.path.rsplit("/", 1)[-1], e.mtime_s) for e in store.list(f"{LEASE_DIR}/"))
    return {name for name, mtime_s in named if mtime_s >= now - within_s and _ID.fullmatch(name)}


def require_live(store: Store, paths: Iterable[str]) -> None:
    """StorageError unless the leases these files were written under were rewritten within half of LEASE_LIVE_S.

    Called just before the files are committed: a lease whose refreshes failed or whose holder
    was paused may have gone stale, and vacuum may have deleted the files. Half the bound leaves
    the other half for the commit itself.
    """
    wanted = {lease for lease in map(lease_of, paths) if lease is not None}
    if not wanted:
        return
    fresh = live_leases(store, within_s=LEASE_LIVE_S / 2)
    lapsed = sorted(wanted - fresh)
    if lapsed:
        raise StorageError(
            f"the write lease {lapsed[0]} in {store.uri} was not refreshed for {LEASE_LIVE_S / 2:.0f} s or more (its refreshes "
            "failed or the process was paused): vacuum may have removed the files written under it; nothing was committed"
        )


class WriteLease:
    """A lease held while files are written and until their commit landed (a context manager).

    `tag` goes into the name of every file written under the lease. The lease file is rewritten
    by a daemon thread every LEASE_REFRESH_S and deleted on exit; a refresh that fails is logged
    and tried again at the next tick (the lease stays live for LEASE_LIVE_S after its last refresh).
    A lease that went unrefreshed for half of LEASE_LIVE_S (failed refreshes, a paused process) is
    broken for good: vacuum may have judged it stale meanwhile, so it is deleted, never refreshed
    back to life, and `require_live` refuses the commit.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.id = uuid.uuid4().hex
        self.tag = f"lease-{self.id}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written = time.monotonic()  # when the lease file was last written

    def __enter__(self) -> WriteLease:
        self._write()  # before any file: an error here stops the write before it starts
        self._thread = threading.Thread(target=self._refresh, name=f"sparkqueue-lease-{self.id[:8]}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):  # a lease left behind goes stale and vacuum removes it
            self.store.delete(self._path)

    @property
    def _path(self) -> str:
        return f"{LEASE_DIR}/{self.id}"

    def _write(self) -> None:
        body = {"host": socket.gethostname(), "pid": os.getpid(), "refreshed_ms": int(time.time() * 1000)}
        self.store.put(self._path, json.dumps(body).encode())
        self._written = time.monotonic()

    def _refresh(self) -> None:
        while not self._stop.wait(LEASE_REFRESH_S):
            if time.monotonic() - self._written > LEASE_LIVE_S / 2:
                log.warning("write lease %s in %s went unrefreshed too long; its commit will be refused", self.id, self.store.uri)
                with contextlib.suppress(Exception):
                    self.store.delete(self._path)
                return
            try:
                self._write()
            except Exception as exc:
                log.warning("could not refresh write lease %s in %s: %s", self.id, self.store.uri, exc)
