"""Where a namespace's bytes live: one small interface over a local directory or an object store.

Everything sparkqueue writes goes through a `Store` rooted at a table or the namespace root:
data files (`put_new`, `put`), Delta log entries (`staged`, a put-if-absent tried under one name
after another: the only primitive optimistic commits need), reads, listings and deletes. A local
directory is written with plain system calls and fsync, so an acknowledged commit survives a
power loss; Azure Blob/ADLS, S3 and GCS go through obstore (Rust's object_store, the library
under delta-rs), whose writes are durable when they return. The same storage-options dict
configures obstore and delta-rs (docs/storage.md).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import math
import os
import posixpath
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from sparkqueue.errors import InvalidOperationError, StorageError

log = logging.getLogger(__name__)

OBJECT_STORE_SCHEMES = ("az", "azure", "abfs", "abfss", "adl", "s3", "s3a", "gs", "gcs")
# Options delta-rs accepts that configure the HTTP client rather than the store.
CLIENT_OPTION_KEYS = frozenset(
    {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout", "pool_idle_timeout", "proxy_url", "user_agent"}
)
PROVIDER_PREFIXES = ("aws_", "azure_", "google_")  # a client option may carry its store's prefix (obstore panics on it)
# delta-rs-only settings (commit locking, unsafe renames) that obstore does not know; sparkqueue needs neither.
DELTA_ONLY_KEYS = frozenset({"allow_unsafe_rename", "aws_s3_locking_provider", "dynamodb_table_name", "aws_conditional_put"})
UNKNOWN_CREATE_TRIES = 3  # conditional creates tried while each ends in a timeout or a lost connection
SYNC_THREADS = 8  # files fsynced at once by LocalStore.sync: the disk flushes their pages in parallel


@dataclass(frozen=True)
class Entry:
    """One listed object: its path relative to the store, size and modification time (seconds since the epoch)."""

    path: str
    size: int
    mtime_s: float


class Store(ABC):
    """Bytes under one root: get, durable put, put-if-absent, list, delete. Paths are relative, '/'-separated."""

    uri: str

    @abstractmethod
    def get(self, path: str) -> bytes:
        """The object's bytes; FileNotFoundError when it does not exist."""

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (fewer when it ends first); FileNotFoundError when it does not exist."""
        return self.get(path)[start:end]

    @abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write (or replace) an object durably."""

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        """Write an object durably under a fresh name nobody else writes (a data file named by a random id).

        Readers reach such an object only through a commit made after this returns, so it
        needs no protection against being read half-written (LocalStore skips the rename).
        """
        self.put(path, bytes(data))

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Write an object durably unless the name exists; False when it did (nothing written)."""

    @contextlib.contextmanager
    def staged(self, data: bytes, folder: str) -> Iterator[Callable[[str], bool]]:
        """Put-if-absent of the same bytes under names in `folder` tried one after another.

        Yields `put(path) -> bool`, as `put_if_absent`. A commit that loses a race tries the next
        version's name with the same entry: a local store writes and fsyncs the bytes once for all
        tries, on entering, so that write overlaps what the caller does before its first put (a
        commit waits there for its data files: docs/storage.md, "Committing").
        """
        yield lambda path: self.put_if_absent(path, data)

    @abstractmethod
    def list(self, prefix: str = "") -> list[Entry]:
        """Objects under a prefix (recursively); empty when there are none."""

    def folders(self, prefix: str) -> builtins.list[str]:
        """The folders directly under `prefix` (a folder path ending in '/'), as store paths without the trailing '/'."""
        return sorted(
            {prefix + e.path[len(prefix) :].split("/", 1)[0] for e in self.list(prefix) if "/" in e.path[len(prefix) :]}
        )

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove an object; a missing one is not an error."""

    @abstractmethod
    def child(self, prefix: str) -> Store:
        """A store rooted at `prefix` below this one."""

    def local_path(self, path: str) -> str | None:
        """The object's path on the local file system, when the store is a local directory."""
        return None

    def sync(self, paths: Sequence[str]) -> None:
        """Make objects written around the store (by Spark's own writer) as durable as a put: a no-op where puts are."""
        return None

    def exists(self, path: str) -> bool:
        """True when the object exists."""
        try:
            self.get(path)
        except FileNotFoundError:
            return False
        return True


class LocalStore(Store):
    """A directory on the local file system, written with fsync so commits survive a power loss."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self.uri = self.root

    def _path(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def get(self, path: str) -> bytes:
        with _translate(self.uri, path), open(self._path(path), "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        """True when the file exists: one stat, no read (DeltaLog.update asks on every call: kept to a bare stat)."""
        try:
            os.stat(self._path(path))
        except FileNotFoundError:
            return False
        except OSError:
            with _translate(self.uri, path):
                raise
        return True

    def get_range(self, path: str, start: int, end: int) -> bytes:
        with _translate(self.uri, path), open(self._path(path), "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def put(self, path: str, data: bytes) -> None:
        """Write a new or replaced file: to a fresh name, fsynced, then moved into place (readers never see half a file)."""
        target = self._path(path)
        with _translate(self.uri, path):
            tmp = self._write_temp(os.path.dirname(target), data)
            os.replace(tmp, target)
            _fsync_dir(os.path.dirname(target))

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        """Create the file, write and fsync it, then fsync its directory: one file and no rename (see Store.put_new)."""
        target = self._path(path)
        with _translate(self.uri, path):
            folder = os.path.dirname(target)
            _make_dirs(folder)
            _write_synced(target, data)
            _fsync_dir(folder)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        with self.staged(data, posixpath.dirname(path)) as put:
            return put(path)

    @contextlib.contextmanager
    def staged(self, data: bytes, folder: str) -> Iterator[Callable[[str], bool]]:
        """Write the bytes to a fresh name in `folder` at once, fsynced; each put hard-links it to a target.

        The link is atomic and refused when the name exists; the fresh name is removed at the end.
        """
        where = self._path(folder)
        with _translate(self.uri, folder):
            tmp = self._write_temp(where, data)

        def put(path: str) -> bool:
            nonlocal tmp
            target = self._path(path)
            with _translate(self.uri, path):
                try:
                    landed = _link(tmp, target)
                except FileNotFoundError:  # the staged name went meanwhile (a table deletion removes it): stage it again
                    tmp = self._write_temp(where, data)
                    landed = _link(tmp, target)
                if not landed:
                    return False
                os.utime(target)  # the entry's time (Delta readers' commit time) is when it landed, not when it was staged
                _fsync_dir(os.path.dirname(target))
                return True

        try:
            yield put
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:  # the table was deleted meanwhile (DeltaLog.commit withdraws the entry)
                pass
            except OSError as exc:  # a leftover temporary name is harmless (vacuum): never fail a commit for it
                log.warning("could not remove %s: %s", tmp, exc)

    def _write_temp(self, folder: str, data: bytes) -> str:
        """Write data to a fresh hidden name in `folder` (a local path), fsynced; returns its path."""
        _make_dirs(folder)
        tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
        _write_synced(tmp, data)
        return tmp

    def list(self, prefix: str = "") -> list[Entry]:
        base = self._path(prefix).rstrip("/")
        out: list[Entry] = []
        with _translate(self.uri, prefix):
            if os.path.isdir(base):
                self._scan(base, base[len(self.root) :].lstrip("/"), out)
        return out

    def folders(self, prefix: str) -> builtins.list[str]:
        """The sub-directories of `prefix`: one directory read, not a walk of the tree."""
        with _translate(self.uri, prefix), contextlib.suppress(FileNotFoundError), os.scandir(self._path(prefix)) as it:
            return sorted(prefix + e.name for e in it if e.is_dir(follow_symlinks=False))
        return []

    def _scan(self, folder: str, rel: str, out: builtins.list[Entry]) -> None:
        """Append the files below `folder` (named `rel` in the store) to `out`, recursively."""
        with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:  # a folder removed while listing
            for e in it:
                name = f"{rel}/{e.name}" if rel else e.name
                with contextlib.suppress(FileNotFoundError):  # removed while listing
                    if e.is_dir(follow_symlinks=False):
                        self._scan(e.path, name, out)
                    else:
                        st = e.stat(follow_symlinks=False)
                        out.append(Entry(name, st.st_size, st.st_mtime))

    def delete(self, path: str) -> None:
        with _translate(self.uri, path), contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(path))

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self._path(prefix.strip("/")))

    def local_path(self, path: str) -> str | None:
        return self._path(path)

    def sync(self, paths: Sequence[str]) -> None:
        """fsync the files side by side (their data reaches the disk in parallel), then their directories and those parents."""
        if not paths:
            return
        targets = [self._path(p) for p in paths]
        with _translate(self.uri, paths[0]), ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="sparkqueue-sync") as pool:
            try:
                list(pool.map(_fsync_file, targets))
            except FileNotFoundError as exc:
                raise StorageError(f"store {self.uri!r}: {exc.filename} vanished before it was made durable") from exc
            folders = {os.path.dirname(t) for t in targets}
            list(pool.map(_fsync_dir, sorted(folders | {os.path.dirname(f) for f in folders})))  # and their entries


class ObjectStore(Store):
    """Azure Blob/ADLS, S3 or GCS through obstore; a put is durable when it returns, put-if-absent is a conditional create."""

    def __init__(self, uri: str, options: Mapping[str, str] | None = None) -> None:
        from obstore.store import from_url

        self.uri = uri.rstrip("/")
        self.options = dict(options or {})
        config, client, retry = _obstore_options(self.options)
        with _translate(self.uri, ""):
            try:
                self._store: Any = from_url(
                    self.uri,
                    config=config or None,  # type: ignore[arg-type]
                    client_options=client or None,  # type: ignore[arg-type]
                    retry_config=retry or None,  # type: ignore[arg-type]
                )
            except ValueError as exc:  # the URL itself (obstore parses it first)
                raise InvalidOperationError(f"namespace URI {self.uri!r} cannot be used: {exc}") from None

    def get(self, path: str) -> bytes:
        import obstore

        with _translate(self.uri, path):
            return bytes(obstore.get(self._store, path).bytes())

    def exists(self, path: str) -> bool:
        """True when the object exists: one HEAD request, no body."""
        import obstore

        try:
            with _translate(self.uri, path):
                obstore.head(self._store, path)
        except FileNotFoundError:
            return False
        return True

    def get_range(self, path: str, start: int, end: int) -> bytes:
        import obstore

        with _translate(self.uri, path):
            return bytes(obstore.get_range(self._store, path, start=start, end=end))

    def put(self, path: str, data: bytes) -> None:
        import obstore

        with _translate(self.uri, path):
            obstore.put(self._store, path, data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """A conditional create; when refused, True still if the object holds exactly `data` (our own create).

        A create whose reply was lost is retried by obstore and refused as existing although it
        landed: taken as a lost race, a commit's entry would stand while its data files were
        deleted. A commit's entry carries a unique id (log.py), so equal bytes are ours. obstore does
        not retry a create that timed out, whose outcome is as unknown: it is tried again here.
        """
        import obstore
        from obstore.exceptions import AlreadyExistsError, GenericError, PreconditionError

        with _translate(self.uri, path):
            for attempt in range(UNKNOWN_CREATE_TRIES):
                try:
                    obstore.put(self._store, path, data, mode="create")
                    return True
                except (AlreadyExistsError, PreconditionError):
                    try:
                        return self.get(path) == data
                    except FileNotFoundError:
                        return False
                except GenericError as exc:  # a timeout or a lost connection: the create may have landed
                    if attempt + 1 == UNKNOWN_CREATE_TRIES:
                        raise
                    # Again, with the same bytes: refused as existing, it tells whether the first one landed.
                    log.info("create of %s/%s has an unknown outcome (%s); trying again", self.uri, path, _first_line(exc))
        raise AssertionError("unreachable")

    def list(self, prefix: str = "") -> list[Entry]:
        import obstore

        with _translate(self.uri, prefix):
            return [
                Entry(m["path"], int(m["size"]), m["last_modified"].timestamp())
                for batch in obstore.list(self._store, prefix or None)
                for m in batch
            ]

    def folders(self, prefix: str) -> builtins.list[str]:
        """The common prefixes under `prefix`: one delimited listing, not a listing of every object."""
        import obstore

        with _translate(self.uri, prefix):
            found = obstore.list_with_delimiter(self._store, prefix or None)
        return sorted(p.rstrip("/") for p in found["common_prefixes"])

    def delete(self, path: str) -> None:
        import obstore

        with _translate(self.uri, path), contextlib.suppress(FileNotFoundError):
            obstore.delete(self._store, path)

    def child(self, prefix: str) -> ObjectStore:
        return ObjectStore(f"{self.uri}/{prefix.strip('/')}", self.options)


_URL_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_SERVICE_CODE = re.compile(r"<Code>\s*(\w+)\s*</Code>")


def resolve_root(root: str | os.PathLike[str]) -> str:
    """A namespace root as sparkqueue stores it: an absolute local path, or an object-store URI without a trailing '/'.

    A relative local root is made absolute, so the namespace opens the same from any directory,
    process or Spark executor. The file-system root itself and empty roots are refused: a
    namespace writes `_catalog` and `entities` under its root. So is anything obstore and delta-rs
    would read as another location: a URI's query or fragment, '.' or '..' segments, URL escapes,
    a backslash or a space at its end.
    """
    if root is None or not isinstance(root, (str, os.PathLike)):
        raise InvalidOperationError(f"a namespace root is a path or a URI, got {root!r}")
    text = os.fspath(root)
    if not isinstance(text, str) or not text.strip() or any(c < " " or c == "\x7f" for c in text):
        raise InvalidOperationError(f"a namespace root is a non-empty path or URI without control characters, got {root!r}")
    scheme, sep, rest = text.partition("://")
    if text.lower().startswith("file:"):
        return _local_root(text, _file_uri_path(text))
    if sep:
        return _object_store_root(text, scheme.lower(), rest)
    return _local_root(text, text)


def _file_uri_path(text: str) -> str:
    """The path of a file URI in any of its forms: file:/a, file:///a, file://localhost/a (another host is refused)."""
    parsed = urlparse(text)
    if parsed.query or parsed.fragment or "?" in text or "#" in text:
        raise InvalidOperationError(f"namespace URI {text!r} has a query or fragment: percent-encode '?' and '#' in a file URI")
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise InvalidOperationError(f"namespace URI {text!r} is not a local file URI: write file:///absolute/path")
    return unquote(parsed.path)


def _object_store_root(text: str, scheme: str, rest: str) -> str:
    """An object-store root, checked: a known scheme, a container or bucket, no query, fragment or dot segments."""
    if scheme not in OBJECT_STORE_SCHEMES:
        raise InvalidOperationError(
            f"unsupported namespace URI scheme {scheme!r}: use a local path, file://, "
            f"or one of {', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}"
        )
    bucket, _, path = rest.partition("/")
    container, at, host = bucket.partition("@")  # abfs[s]://container@account.dfs.core.windows.net/path
    if not bucket or (at and not (container and host)):
        raise InvalidOperationError(f"namespace URI {text!r} names no container or bucket")
    if "?" in rest or "#" in rest:
        raise InvalidOperationError(f"namespace URI {text!r} has a query or fragment, which the store would drop")
    segments = path.rstrip("/").split("/") if path.rstrip("/") else []
    if any(seg in ("", ".", "..") for seg in segments):
        raise InvalidOperationError(f"namespace URI {text!r} has an empty, '.' or '..' segment; write the path it means")
    if _URL_ESCAPE.search(path):  # the store decodes it: 'a%20b' would name the namespace at 'a b'
        raise InvalidOperationError(
            f"namespace URI {text!r} holds a URL escape ('%' and two hex digits), which the store decodes into "
            "another path; write the path it means"
        )
    root = f"{scheme}://{rest.rstrip('/')}"
    # obstore's URL parser drops spaces at the end (the namespace marker went to 'ns' while the tables went under
    # 'ns '), and delta-rs reads a backslash as '/': either would put part of the namespace outside its root
    if root.endswith(" ") or "\\" in rest:
        raise InvalidOperationError(
            f"namespace URI {text!r} ends in a space or holds a backslash, which the stores read as another path; "
            "write the path it means"
        )
    return root


def _local_root(text: str, path: str) -> str:
    """A local root as an absolute path, refused where delta-rs would read another path."""
    local = Path(path).expanduser().resolve()
    if local.parent == local:
        raise InvalidOperationError(f"namespace root {text!r} is the file-system root; choose a directory for the namespace")
    if _URL_ESCAPE.search(str(local)) or "\\" in str(local):
        raise InvalidOperationError(
            f"namespace root {text!r} holds a URL escape ('%' and two hex digits) or a backslash, which delta-rs "
            "reads as another path; choose a directory without them"
        )
    return str(local)


def check_storage_options(options: Mapping[str, str] | None, root: str | None = None) -> dict[str, str]:
    """Storage options as a plain dict of strings (delta-rs's and obstore's shape); anything else is refused.

    Given the (resolved) `root`, an option naming another container, bucket or account than the
    root's is refused too: obstore lets such an option win over the URI and delta-rs does not, so the
    namespace would be split over two locations, one of them outside its root.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidOperationError(f"storage_options must be a dict of strings, got {type(options).__name__}")
    out: dict[str, str] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise InvalidOperationError(f"storage_options keys must be strings, got {key!r}")
        if not isinstance(value, (str, bool, int, float)) or isinstance(value, float):
            raise InvalidOperationError(f"storage_options[{key!r}] must be a string, got {value!r}")
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    if root is not None:
        _check_location(root, out)
        _check_plain_http(root, out)
    return out


ENDPOINT_KEYS = frozenset({"endpoint", "endpoint_url"})  # bare keys (see _bare_key), "storage_" dropped as well
TRUTHY = frozenset({"true", "1", "yes", "on"})  # how object_store reads a boolean option


def _check_plain_http(root: str, options: Mapping[str, str]) -> None:
    """Refuse an http:// endpoint without allow_http (or use_emulator), which obstore reports only as "builder error".

    The allowance may come from the options or from the environment (AZURE_ALLOW_HTTP, ...), as obstore reads it.
    """
    if is_local(root):
        return
    bare = {_bare_key(k).removeprefix("storage_"): v for k, v in options.items()}
    endpoint = next((v for k, v in bare.items() if k in ENDPOINT_KEYS and v.lower().startswith("http://")), None)
    if endpoint is None:
        return
    prefix = ENVIRONMENT_PREFIXES.get(urlparse(root).scheme.lower(), "")
    allowed = [bare.get("allow_http"), bare.get("use_emulator"), os.environ.get(f"{prefix}ALLOW_HTTP")]
    allowed.append(os.environ.get(f"{prefix}STORAGE_USE_EMULATOR") if prefix == "AZURE_" else None)
    if not any(str(v).strip().lower() in TRUTHY for v in allowed if v is not None):
        raise InvalidOperationError(
            f"storage endpoint {endpoint!r} is plain HTTP, which the object store client refuses unless allowed: "
            "add storage option allow_http='true' (an emulator such as Azurite on loopback), or use an https:// endpoint"
        )


LOCATION_KEYS = {"container_name": "container", "bucket": "bucket", "bucket_name": "bucket", "account_name": "account"}


def _check_location(root: str, options: Mapping[str, str]) -> None:
    """Refuse options that name another container, bucket or account than `root` does (see check_storage_options)."""
    if is_local(root):
        return
    parsed = urlparse(root)
    host = parsed.netloc
    named = {"container": host, "bucket": host, "account": None}
    if parsed.scheme.lower() in ("abfs", "abfss") and "@" in host:  # abfss://container@account.dfs.core.windows.net/...
        container, _, domain = host.partition("@")
        named.update(container=container, account=domain.split(".", 1)[0])
    for key, value in options.items():
        what = LOCATION_KEYS.get(_bare_key(key).removeprefix("storage_"))
        if what is not None and named[what] is not None and value != named[what]:
            raise InvalidOperationError(
                f"storage_options[{key!r}] names {what} {value!r}, but the root {root!r} names {named[what]!r}: "
                "the root says where the namespace is; leave the option out"
            )


def is_local(root: str) -> bool:
    """True for a root on the local file system (as `resolve_root` returns it)."""
    return "://" not in root


def open_store(root: str, options: Mapping[str, str] | None = None) -> Store:
    """The store at a resolved root (see `resolve_root`)."""
    return LocalStore(root) if is_local(root) else ObjectStore(root, options)


def _obstore_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """Split delta-rs style storage options into obstore's store config, HTTP client options and retry config."""
    config: dict[str, str] = {}
    client: dict[str, str] = {}
    retry: dict[str, Any] = {}
    for key, value in options.items():
        k = key.lower()
        if k in DELTA_ONLY_KEYS:
            continue
        bare = _bare_key(k)
        if bare in CLIENT_OPTION_KEYS:
            client[bare] = str(value)
        elif k == "max_retries":
            retry["max_retries"] = _whole(k, value)
        elif k == "retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=_seconds(k, value))
        else:
            config[k] = str(value)
    return config, client, retry


def with_deadline_options(root: str, options: Mapping[str, str], seconds: float) -> dict[str, str]:
    """Storage options whose request timeout and retries fit an operation timeout (those the user set are kept).

    obstore (and delta-rs) otherwise wait 30 s per request and retry for 3 minutes, so a hung store
    would hold every call far past its `operation_timeout`.
    """
    if is_local(root):
        return dict(options)
    given = {_bare_key(k) for k in options}
    out = dict(options)
    # Client options given at all replace those obstore reads from the environment (AZURE_ALLOW_HTTP, say), so the
    # request timeout takes the environment's client options along, as delta-rs does: options given in part, or none
    # (a namespace configured by environment variables alone). A timeout set in the environment is kept.
    if "timeout" not in given:
        out.update({k: v for k, v in _environment_client_options(root).items() if k not in given})
        out.setdefault("timeout", f"{max(1, math.ceil(min(30.0, seconds)))}s")
    if "retry_timeout" not in given:
        out["retry_timeout"] = f"{max(1, math.ceil(seconds))}s"
    return out


ENVIRONMENT_PREFIXES = {"az": "AZURE_", "azure": "AZURE_", "adl": "AZURE_", "abfs": "AZURE_", "abfss": "AZURE_"}
ENVIRONMENT_PREFIXES |= {"s3": "AWS_", "s3a": "AWS_", "gs": "GOOGLE_"}


def _environment_client_options(root: str) -> dict[str, str]:
    """The HTTP client options the root's store takes from its environment variables (AZURE_ALLOW_HTTP, ...)."""
    prefix = ENVIRONMENT_PREFIXES.get(urlparse(root).scheme.lower())
    if prefix is None:
        return {}
    return {k: os.environ[prefix + k.upper()] for k in sorted(CLIENT_OPTION_KEYS) if prefix + k.upper() in os.environ}


def _bare_key(key: str) -> str:
    """An option key lower-cased and without its store's prefix: delta-rs also takes "aws_allow_http", ..."""
    k = key.lower()
    return k.split("_", 1)[1] if k.startswith(PROVIDER_PREFIXES) else k


def _seconds(key: str, value: object) -> float:
    """A duration option: seconds, as "5", "5s" or "500ms"."""
    text = str(value).strip().lower()
    scale = 0.001 if text.endswith("ms") else 1.0
    try:
        return float(text.removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        raise InvalidOperationError(f"storage option {key} must be a duration such as '30s', got {value!r}") from None


def _whole(key: str, value: object) -> int:
    """A count option."""
    try:
        return int(str(value))
    except ValueError:
        raise InvalidOperationError(f"storage option {key} must be a whole number, got {value!r}") from None


# Error codes object stores answer a request in a container or bucket that does not exist with (Azure, S3 and GCS).
_NO_BUCKET_CODES = ("ContainerNotFound", "NoSuchBucket")


@contextlib.contextmanager
def _translate(uri: str, path: str) -> Iterator[None]:
    """Turn store failures other than a missing object into StorageError naming the store."""
    try:
        yield
    except FileNotFoundError as exc:
        match = _SERVICE_CODE.search(str(exc))  # the service's <Code>, never the path (which may hold the same words)
        code = match.group(1) if match and match.group(1) in _NO_BUCKET_CODES else None
        if code is not None:  # not a missing object: a missing container or bucket, where "absent" would read as empty
            raise StorageError(f"store {uri!r} failed on {path!r}: its container or bucket does not exist ({code})") from exc
        raise
    except (PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        raise StorageError(f"store {uri!r} refused access to {path!r}: {exc}") from exc
    except OSError as exc:
        raise StorageError(f"store {uri!r} failed on {path!r}: {exc}") from exc
    except BaseException as exc:
        name = type(exc).__name__
        module = type(exc).__module__ or ""
        if module == "pyo3_runtime":  # a panic in obstore's Rust code (a BaseException): its message says what was wrong
            raise StorageError(f"store {uri!r} failed on {path!r}: {_first_line(exc)}") from exc
        if not module.startswith("obstore"):
            raise
        if name == "NotFoundError":
            raise FileNotFoundError(f"{uri}/{path}") from exc
        raise StorageError(f"store {uri!r} failed on {path!r} ({name}): {_first_line(exc)}") from exc


@contextlib.contextmanager
def delta_rs_errors(uri: str, what: str) -> Iterator[None]:
    """Turn a delta-rs failure (its DeltaError, or an OSError from its object store) into StorageError naming the table."""
    try:
        yield
    except Exception as exc:
        from deltalake.exceptions import DeltaError  # its classes live in the module "_internal", not "deltalake..."

        module = type(exc).__module__ or ""
        if not (module.startswith("deltalake") or isinstance(exc, (DeltaError, OSError))):
            raise
        raise StorageError(f"{what} {uri} failed: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """An error's first line, with the service's error code when the rest holds one (Azure: <Code>ContainerNotFound</Code>)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    code = _SERVICE_CODE.search(text)
    return f"{first} [{code.group(1)}]" if code and code.group(1) not in first else first


def _write_synced(path: str, data: bytes | memoryview) -> None:
    """Create a new file (never an existing one) holding `data`, fsynced; the process umask applies to its mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _link(source: str, target: str) -> bool:
    """Hard-link `source` to `target`, atomically; False when `target` exists (nothing changed)."""
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    return True


def _make_dirs(folder: str) -> None:
    """Create a folder and its missing parents, each new one made durable in its parent (a first write to a partition)."""
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(folder)
    if parent and parent != folder:
        _make_dirs(parent)
    with contextlib.suppress(FileExistsError):  # made by a concurrent writer: its entry may not be durable yet either
        os.mkdir(folder)
    _fsync_dir(parent)


def _fsync_file(path: str) -> None:
    """Flush a file written elsewhere (its data and size) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: str) -> None:
    """Make a directory's new entries durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
