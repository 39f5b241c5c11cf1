"""A local SparkSession configured for sparkqueue, with its data source registered (an entry point, like the data source)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

from sparkqueue.spark.datasource import register

log = logging.getLogger(__name__)

# Settings every sparkqueue session needs (workers run this interpreter, so sparkqueue imports there).
DEFAULT_CONF: dict[str, str] = {
    "spark.pyspark.python": sys.executable,
    "spark.pyspark.driver.python": sys.executable,
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
    "spark.python.daemon.module": "sparkqueue.spark.daemon",  # workers fork with sparkqueue already imported
    "spark.ui.showConsoleProgress": "false",
}


def spark_session(
    master: str | None = "local[2]", app_name: str = "sparkqueue", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A SparkSession configured for sparkqueue (workers on this interpreter, UTC, Arrow), data source registered.

    master=None leaves the master to the launcher (spark-submit --master).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    workers = getattr(spark.sparkContext, "pythonExec", None)
    if workers and os.path.realpath(workers) != os.path.realpath(sys.executable):
        # getOrCreate returned a session started before, whose workers run another interpreter: stop it first
        log.warning(
            "spark_session() reused a running SparkSession whose Python workers run %s, not %s; sparkqueue's DataFrame "
            "calls need workers that import sparkqueue: call spark.stop() and spark_session() again",
            workers,
            sys.executable,
        )
    register(spark)
    return spark
