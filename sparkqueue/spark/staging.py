"""Staging directories: where Spark tasks leave received messages and settle results for the returned DataFrame.

`receive_dataframe` and the `*_dataframe` settle calls act once, in Spark tasks that write what
they did to Parquet files under ``<namespace root>/_spark_staging/<kind>/<stamp>-<id>/``; the
DataFrame they return reads those files, so evaluating it again never receives or settles again.

Cleanup: each call removes staging directories older than `STAGING_RETENTION` (1 hour; the
longest lock lasts 5 minutes). `release(df)` removes the directories a returned DataFrame reads
at once, and `cleanup_staging(root, older_than)` sweeps a namespace, e.g. from a scheduled job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as st

from sparkqueue.errors import InvalidOperationError
from sparkqueue.storage.files import DataFiles, encode_parquet

log = logging.getLogger(__name__)

STAGING_DIR = "_spark_staging"
STAGING_RETENTION = timedelta(hours=1)
STAGING_ATTRIBUTE = "_sparkqueue_staging"  # attribute of a returned DataFrame: the staging directory it reads
LOCKED_ATTRIBUTE = "_sparkqueue_locked"  # attribute of a DataFrame a peek-lock receive returned (its rows hold locks)
_STAMP = "%Y%m%dT%H%M%S"


def is_local_location(uri: str) -> bool:
    """True for a local path or a `file:` URI (the forms Spark prints); False for an object-store URI."""
    return "://" not in uri or uri.startswith("file:")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path of `uri` on it (local paths made absolute)."""
    if is_local_location(uri):
        return pafs.LocalFileSystem(), local_path(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def local_path(location: str) -> str:
    """A local location (a relative or absolute path, or a file: URI) as an absolute path without a trailing '/'."""
    path = local_uri(location) if location.startswith("file:") else location
    return os.path.abspath(path).rstrip("/") or "/"


def local_uri(uri: str) -> str:
    """A Spark file URI (file:/a, file:///a) as a plain path; other URIs unchanged."""
    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri


def spark_path(uri: str) -> str:
    """The form Spark reads a location in: `file://` + an absolute path for local locations, other URIs unchanged.

    A relative path would become `file://./x`, which Hadoop reads as host "." and rejects ("Wrong FS").
    The path is not percent-encoded: Hadoop takes the path part of a `file://` location literally.
    """
    if not is_local_location(uri):
        return uri
    return f"file://{local_path(uri)}"


def require_local_root(root: str, what: str) -> None:
    """Refuse, before anything is locked or sent, a Spark call that stages files on an object-store namespace.

    Staging directories are written by Python tasks and read by Spark's own reader, which needs
    the store's Hadoop file system under the same URI; that is not built yet (docs/spark-streaming.md).
    """
    if not is_local_location(root):
        raise InvalidOperationError(
            f"{what} is not supported yet on an object-store namespace ({root}); it works on a local or mounted "
            "path (e.g. /dbfs/...). On object stores use the core API, send_dataframe or the batch reader"
        )


def _glob_escaped(path: str) -> str:
    """A path Hadoop's glob matching reads literally: its pattern characters escaped (a root may be named "q[1]")."""
    return "".join(f"\\{c}" if c in _GLOB_CHARS else c for c in path)


_GLOB_CHARS = frozenset("\\*?[]{}")


@dataclass(frozen=True)
class Staging:
    """One staging directory (picklable: tasks write into it)."""

    uri: str

    @classmethod
    def create(cls, root: str, kind: str) -> Staging:
        """A new, empty staging directory of a kind ("receive", "settle") under the namespace root."""
        require_local_root(root, f"a Spark {kind}")
        stamp = datetime.now(UTC).strftime(_STAMP)
        root = local_path(root)  # absolute: Spark tasks and the returned DataFrame may run in another directory
        staging = cls(f"{root.rstrip('/')}/{STAGING_DIR}/{kind}/{stamp}-{uuid.uuid4().hex[:12]}")
        fs, path = filesystem(staging.uri)
        fs.create_dir(path, recursive=True)
        return staging

    def write(self, name: str, table: pa.Table) -> None:
        """Write a Parquet file atomically where the filesystem renames atomically (temp name, then rename)."""
        fs, path = filesystem(self.uri)
        tmp = f"{path}/_tmp-{uuid.uuid4().hex}-{name}"  # names starting with '_' are invisible to Spark
        with fs.open_output_stream(tmp) as out:
            out.write(encode_parquet(table))
        fs.move(tmp, f"{path}/{name}")

    def link(self, name: str, data: DataFiles, source: str) -> None:
        """Stage an immutable table file under `name` without copying it where the filesystem allows (a hard link).

        A linked table file stays readable here after the table's vacuum deletes it, until the
        staging directory is removed. Elsewhere (object stores) the file is copied.
        """
        fs, path = filesystem(self.uri)
        tmp = f"{path}/_tmp-{uuid.uuid4().hex}-{name}"
        linked = False
        local = data.store.local_path(source)
        if isinstance(fs, pafs.LocalFileSystem) and local is not None:
            try:
                os.link(local, tmp)
                linked = True
            except OSError as exc:  # another device, or links not supported: copy instead
                log.debug("cannot link %s into staging (%s); copying it", local, exc)
        if not linked:
            with fs.open_output_stream(tmp) as out:
                out.write(data.store.get(source))
        fs.move(tmp, f"{path}/{name}")  # replaces a file of that name (a failed task attempt's)

    def remove(self, prefix: str) -> int:
        """Delete the directory's files whose name starts with `prefix` (what a failed task attempt left); returns how many."""
        fs, path = filesystem(self.uri)
        names = [n for n in self.names() if n.startswith(prefix)]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(f"{path}/{name}")
        return len(names)

    def names(self, part: str = "") -> list[str]:
        """Names of the directory's finished Parquet files whose name contains `part`."""
        fs, path = filesystem(self.uri)
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(
            i.base_name
            for i in infos
            if i.is_file and not i.base_name.startswith("_") and i.base_name.endswith(".parquet") and part in i.base_name
        )

    def read_file(self, name: str, columns: list[str] | None = None) -> pa.Table:
        """One staged file (some of its columns)."""
        fs, path = filesystem(self.uri)
        return pq.read_table(f"{path}/{name}", filesystem=fs, columns=columns)

    @staticmethod
    def of_receive(df: DataFrame) -> Staging | None:
        """The staging directory of a DataFrame exactly as a peek-lock receive returned it, while it exists; else None.

        None for a DataFrame derived from it (its rows are unknown), one of RECEIVE_AND_DELETE, or one released.
        """
        uri = getattr(df, STAGING_ATTRIBUTE, None)
        if not isinstance(uri, str) or getattr(df, LOCKED_ATTRIBUTE, False) is not True:
            return None
        fs, path = filesystem(uri)
        return Staging(uri) if fs.get_file_info(path).type == pafs.FileType.Directory else None

    def read(self, spark: SparkSession, schema: st.StructType) -> DataFrame:
        """A DataFrame over the directory's files (empty while there are none), tagged with the directory."""
        df = spark.read.schema(schema).parquet(_glob_escaped(self.spark_path))  # Spark reads a path as a glob pattern
        setattr(df, STAGING_ATTRIBUTE, self.uri)
        return df

    @property
    def spark_path(self) -> str:
        """The directory as Spark reads it."""
        return spark_path(self.uri)


def cleanup_staging(root: str, older_than: timedelta = STAGING_RETENTION) -> int:
    """Remove staging directories of a namespace older than `older_than`; returns how many were removed."""
    if not is_local_location(root):
        return 0  # nothing is staged on object-store namespaces (require_local_root)
    fs, base = filesystem(f"{root.rstrip('/')}/{STAGING_DIR}")
    cutoff = datetime.now(UTC) - older_than
    removed = 0
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except OSError:
        return 0
    for kind in (i for i in infos if i.type == pafs.FileType.Directory):
        for d in fs.get_file_info(pafs.FileSelector(kind.path, allow_not_found=True)):
            if d.type != pafs.FileType.Directory:
                continue
            try:
                made = datetime.strptime(d.base_name.split("-", 1)[0], _STAMP).replace(tzinfo=UTC)
            except ValueError:
                continue
            if made < cutoff:
                with contextlib.suppress(OSError):
                    fs.delete_dir(d.path)
                    removed += 1
    if removed:
        log.info("removed %d staging directories older than %s under %s", removed, older_than, root)
    return removed


def remove_dirs(uris: list[str]) -> int:
    """Delete staging directories by URI (those under a `_spark_staging` directory only); returns how many."""
    removed = 0
    for uri in uris:
        if f"/{STAGING_DIR}/" not in uri:
            raise ValueError(f"{uri!r} is not a sparkqueue staging directory")
        fs, path = filesystem(local_uri(uri))
        with contextlib.suppress(OSError):
            fs.delete_dir(path)
            removed += 1
    return removed
