"""Spark's Python worker daemon, with sparkqueue imported before it forks workers (`spark.python.daemon.module`).

Workers are forked from the daemon, so each new one starts with pyarrow, deltalake and the
sparkqueue task code already loaded instead of importing them (most of a second) in its first
task. spark_session() sets this module; a cluster needs sparkqueue installed on its workers.
Only modules are imported here: no thread pool or runtime starts before the fork.
"""

from __future__ import annotations

from pyspark.daemon import manager

import sparkqueue.spark.datasource
import sparkqueue.spark.receive
import sparkqueue.spark.send
import sparkqueue.spark.settle  # noqa: F401 - imported for the forked workers

if __name__ == "__main__":
    manager()
