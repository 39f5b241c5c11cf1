"""Spark fixtures: ONE local[2] SparkSession for every Spark test (starting one costs seconds), and DataFrame helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

TEST_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.driver.memory": "2g",
    "spark.ui.enabled": "false",
}


def pytest_configure(config: pytest.Config) -> None:
    """pyspark warns that it does not fully support pandas 3; sparkqueue's Spark paths use Arrow, not pandas."""
    config.addinivalue_line("filterwarnings", "ignore:PySpark does not yet fully support pandas:FutureWarning")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the node id's @group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`--dist loadgroup`), every Spark test runs in one worker: one JVM, one shared session."""
    for item in items:
        if item.path.parent.name == "spark":
            item.add_marker(pytest.mark.xdist_group("spark"))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The shared local[2] session, configured by sparkqueue.spark.spark_session (workers on this venv)."""
    from sparkqueue.spark import spark_session

    session = spark_session("local[2]", "sparkqueue-tests", conf=TEST_CONF)
    session.sparkContext.setLogLevel("FATAL")
    yield session
    session.stop()


def make_numbered(spark: SparkSession, n: int, *, partitions: int = 2, body_bytes: int = 0) -> DataFrame:
    """n rows: `id`, `body` ("msg-<id>" padded to body_bytes) and `message_id` ("m-<id>")."""
    body = sf.concat(sf.lit("msg-"), sf.col("id").cast("string"))
    if body_bytes:
        body = sf.rpad(body, body_bytes, "x")
    return spark.range(0, n, 1, partitions).select(
        "id", body.cast("binary").alias("body"), sf.concat(sf.lit("m-"), sf.col("id").cast("string")).alias("message_id")
    )


@pytest.fixture
def numbered(spark: SparkSession) -> Callable[..., DataFrame]:
    """make_numbered bound to the shared session: numbered(n, partitions=2, body_bytes=0)."""
    return lambda n, **kw: make_numbered(spark, n, **kw)
