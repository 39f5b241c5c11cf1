"""What the Spark jobs share: configuration (conf/sparkqueue.toml plus command-line overrides), session and queue."""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkqueue import Namespace
from sparkqueue.errors import EntityAlreadyExistsError, EntityNotFoundError, SparkQueueError
from sparkqueue.model.properties import QueueProperties

if TYPE_CHECKING:  # pyspark is imported only by the jobs that start Spark (maintenance does not)
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "conf" / "sparkqueue.toml"
LOG4J_CONF = DEFAULT_CONFIG.with_name("log4j2.properties")  # Spark's JVM log for the jobs (see quiet_spark_log)

DEFAULTS: dict[str, Any] = {
    # tier None: an existing namespace's own, "standard" for a new one (a set tier must match an existing one's).
    "namespace": {"root": "./sparkqueue-data", "tier": None, "operation_timeout": 60},
    "spark": {"master": "local[2]", "app_name": "sparkqueue-job", "conf": {}},
    "queue": {
        "name": "orders",
        "create": True,
        "enable_partitioning": True,
        "requires_duplicate_detection": False,
        "lock_duration": 60,
        "max_delivery_count": 10,
    },
    "producer": {"source": "", "format": "parquet", "generate": 100_000, "body_bytes": 1024, "id_prefix": ""},
    "consumer": {
        "batch_size": 50_000,
        "max_messages": 1_000_000,
        "max_wait_time": 0,
        "transform": "jobs.transforms:uppercase",
        "output": "",  # default: <namespace root>/_output/<queue> (jobs.consumer.output_path)
    },
    "stream_consumer": {"checkpoint": "", "max_messages_per_trigger": 50_000, "trigger": "available_now"},
}
FREE_FORM = ("spark", "conf")  # any Spark setting goes under spark.conf; every other key must be one of DEFAULTS
NOT_ONLY_STRINGS = {"stream_consumer.trigger"}  # "available_now" or seconds; other settings with a string default take strings
BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}

# Named flags and the configuration keys they set.
FLAGS = {
    "root": "namespace.root",
    "queue": "queue.name",
    "master": "spark.master",
    "lock_duration": "queue.lock_duration",
}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every job takes: the config file, the common overrides, and generic `--set key=value`."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML configuration file (default: conf/sparkqueue.toml)")
    parser.add_argument("--root", help="namespace root (namespace.root)")
    parser.add_argument("--queue", help="queue name (queue.name)")
    parser.add_argument("--master", help="Spark master, ignored under spark-submit (spark.master)")
    parser.add_argument("--lock-duration", dest="lock_duration", type=float, help="seconds, when the job creates the queue")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override any setting")
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, Spark's INFO log and full stack traces")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """The --config flag alone, for jobs without the Spark and queue overrides (maintenance)."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML configuration file (default: conf/sparkqueue.toml)")


def load_config(path: str | os.PathLike[str] | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, updated by the TOML file (if it exists), updated by dotted-key overrides."""
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None and Path(path).exists():
        with open(path, "rb") as f:
            from_file = tomllib.load(f)
        _check_keys(from_file, f"configuration file {path}")
        _merge(cfg, from_file)
    elif path is not None and Path(path) != DEFAULT_CONFIG:
        raise FileNotFoundError(f"configuration file {path} does not exist")
    for key, value in (overrides or {}).items():
        _set(cfg, key, value)
    return cfg


def overrides_from(args: argparse.Namespace, flags: dict[str, str] | None = None) -> dict[str, Any]:
    """Dotted-key overrides from parsed arguments: named flags that were given, then each --set."""
    out: dict[str, Any] = {}
    for attr, key in {**FLAGS, **(flags or {})}.items():
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = value
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        key = key.strip()
        out[key] = _parse_value(raw) if not _takes_text(key) or raw.strip()[:1] in "\"'" else raw  # id_prefix=2024: text
    return out


def _takes_text(dotted: str) -> bool:
    """True for a setting whose value is a name, path or text (its default is a string): `--set` gives it the raw text."""
    node: Any = DEFAULTS
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, str) and dotted not in NOT_ONLY_STRINGS


def _parse_value(raw: str) -> Any:
    """A TOML value (number, boolean, quoted string, array), else the raw text."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _merge(base: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _check_keys(tree: Mapping[str, Any], where: str, known: Mapping[str, Any] = DEFAULTS, at: tuple[str, ...] = ()) -> None:
    """Refuse a setting no job reads (a misspelt key would be ignored silently)."""
    for key, value in tree.items():
        path = (*at, key)
        if key not in known:
            raise ValueError(f"{where}: unknown setting {'.'.join(path)!r}")
        if isinstance(known[key], dict) != isinstance(value, dict):
            kind = "a section, not a value" if isinstance(known[key], dict) else "a value, not a section"
            raise ValueError(f"{where}: {'.'.join(path)!r} is {kind}")
        if isinstance(known[key], str) and not isinstance(value, str) and ".".join(path) not in NOT_ONLY_STRINGS:
            # queue.name = 5 made a queue "5" in one job and was refused by another; format = 5 failed inside Spark
            raise ValueError(f'{where}: {".".join(path)!r} must be a string, got {value!r} (quote it: "{value}")')
        if isinstance(value, dict) and path != FREE_FORM:
            _check_keys(value, where, known[key], path)


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if tuple(parts[:2]) == FREE_FORM and len(parts) > 2:  # spark.conf.<a Spark setting, dots and all>
        cfg["spark"]["conf"][".".join(parts[2:])] = value
        return
    tree: dict[str, Any] = value
    for part in reversed(parts):
        tree = {part: tree}
    _check_keys(tree, "--set")
    *path, last = parts
    node = cfg
    for part in path:
        node = node[part]
    node[last] = value


def flag(cfg: dict[str, Any], dotted: str) -> bool:
    """A yes/no setting ("section.key"): a TOML boolean, or true/false, yes/no, 1/0 in any case; ValueError otherwise."""
    section, key = dotted.split(".", 1)
    raw = cfg[section][key]
    if isinstance(raw, bool):
        return raw
    value = BOOLEANS.get(str(raw).strip().lower())
    if value is None:
        raise ValueError(f"setting {dotted} must be true or false, got {raw!r}")
    return value


def number(cfg: dict[str, Any], dotted: str, kind: type[int] | type[float] = int, minimum: float = 0) -> Any:
    """A numeric setting ("section.key") as `kind`, at least `minimum`; ValueError naming the setting otherwise."""
    section, key = dotted.split(".", 1)
    raw = cfg[section][key]
    try:
        value = kind(raw)
        if kind is int and value != float(raw):  # int(1.5) is 1: a fraction would be cut silently
            raise ValueError(raw)
    except (TypeError, ValueError):
        raise ValueError(f"setting {dotted} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"setting {dotted} must be at least {minimum}, got {raw!r}")
    return value


def under_spark_submit() -> bool:
    """True when spark-submit launched this process (it then owns the master and the gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def quiet_spark_log(conf: Mapping[str, str], verbose: bool) -> dict[str, str]:
    """`conf` plus the driver option that points Spark's JVM log at conf/log4j2.properties (WARN, no start-up chatter).

    Takes effect where this process starts the JVM; under spark-submit, pass the file with
    --driver-java-options (jobs/cron.example). `verbose` leaves Spark's own log settings alone.
    """
    out = dict(conf)
    if verbose or not LOG4J_CONF.is_file():
        return out
    option = f"-Dlog4j2.configurationFile={LOG4J_CONF.as_uri()}"
    key = "spark.driver.extraJavaOptions"
    out[key] = f"{out[key]} {option}" if out.get(key) else option
    return out


def session(cfg: dict[str, Any], *, verbose: bool = False) -> SparkSession:
    """The job's SparkSession: sparkqueue defaults, then the configured Spark settings; Spark logs at WARN unless verbose.

    Spark's own INFO lines (one per task and stage) would bury the job's; `--verbose` brings them back.
    """
    from sparkqueue.spark import spark_session

    spark_cfg = cfg["spark"]
    conf = {str(k): str(v) for k, v in spark_cfg.get("conf", {}).items()}
    master = None if under_spark_submit() else spark_cfg["master"]
    spark = spark_session(master, spark_cfg["app_name"], quiet_spark_log(conf, verbose))
    spark.sparkContext.setLogLevel("INFO" if verbose else "WARN")
    return spark


def namespace(cfg: dict[str, Any], *, create: bool | None = None) -> Namespace:
    """The configured namespace; created when missing only if `create` (default: when the job may create its queue).

    Only producers create one: a consumer pointed at a mistyped root fails instead of draining a new, empty namespace.
    """
    ns_cfg = cfg["namespace"]
    return Namespace(
        ns_cfg["root"],
        ns_cfg.get("tier") or None,
        operation_timeout=number(cfg, "namespace.operation_timeout", float),
        create=flag(cfg, "queue.create") if create is None else create,
    )


Numbers = tuple[tuple[str, type[int] | type[float], float], ...]  # (setting, type, minimum) of a job's numeric settings


def numbers(cfg: dict[str, Any], spec: Numbers) -> list[Any]:
    """The settings `spec` names, checked (`number`), in its order; queue.lock_duration is checked too.

    A job calls it before Spark starts, so a bad value fails in a second rather than after ten, and again for the values.
    """
    number(cfg, "queue.lock_duration", float)
    return [number(cfg, key, kind, minimum) for key, kind, minimum in spec]


def require_queue(ns: Namespace, cfg: dict[str, Any]) -> str:
    """The configured queue's name; EntityNotFoundError when it does not exist.

    Consumers never make the queue they read (`queue.create` is the producer's): a mistyped name
    would otherwise be a new, empty queue, and the run an empty success.
    """
    ns.get_queue(cfg["queue"]["name"])
    return str(cfg["queue"]["name"])


def check_source(cfg: dict[str, Any], what: str) -> None:
    """A consumer's namespace and queue exist, checked before Spark starts: a mistyped root or queue fails in one line.

    So does a root the consumer's Spark receive (`what`) cannot work on yet (an object store), before it changes anything.
    """
    from sparkqueue.spark.staging import require_local_root  # Spark's modules: for the Spark jobs only

    require_local_root(str(cfg["namespace"]["root"]), what)
    with namespace(cfg, create=False) as ns:
        require_queue(ns, cfg)


def ensure_queue(ns: Namespace, cfg: dict[str, Any]) -> str:
    """The configured queue's name, creating the queue with the configured settings when allowed and missing (the producer)."""
    name = str(cfg["queue"]["name"])
    wanted = queue_settings(cfg)
    try:
        warn_of_other_settings(ns.get_queue(name), wanted)
        return name
    except EntityNotFoundError:
        if not flag(cfg, "queue.create"):
            raise
    try:
        ns.create_queue(name, **wanted)
        log.info("created queue %s", name)
    except EntityAlreadyExistsError:
        warn_of_other_settings(ns.get_queue(name), wanted)  # another job created it first
    return name


def queue_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The [queue] settings a created queue gets, as create_queue's keyword arguments."""
    return {
        "enable_partitioning": flag(cfg, "queue.enable_partitioning"),
        "requires_duplicate_detection": flag(cfg, "queue.requires_duplicate_detection"),
        "lock_duration": timedelta(seconds=number(cfg, "queue.lock_duration", float)),
        "max_delivery_count": number(cfg, "queue.max_delivery_count", int, 1),
    }


def _shown(value: object) -> str:
    """A setting's value as the config writes it (a duration in seconds)."""
    return f"{value.total_seconds():g}" if isinstance(value, timedelta) else repr(value)


def warn_of_other_settings(props: QueueProperties, wanted: dict[str, Any]) -> None:
    """Log the configured [queue] settings an existing queue does not have: the queue's own settings apply."""
    differ = [f"{k} is {_shown(getattr(props, k))}, not {_shown(v)}" for k, v in wanted.items() if getattr(props, k) != v]
    if differ:
        log.warning(
            "queue %s exists with other settings than the config's [queue] (which apply only when the producer creates "
            "it): %s; the queue's settings apply (Namespace.update_queue changes those that can change)",
            props.name,
            "; ".join(differ),
        )


def setup_logging(verbose: bool) -> None:
    """Job logging to stderr (library modules log; jobs never print): the job's own lines at INFO, the rest at WARNING.

    With `verbose`, everything at DEBUG (py4j and deltalake stay at WARNING: their DEBUG lines say nothing about the job).
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("jobs").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("py4j", "deltalake"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def summary(exc: BaseException) -> str:
    """An error in one line: a Spark failure without its JVM stack trace, a sparkqueue error a task carried as itself."""
    try:
        from sparkqueue.spark.session import translate

        carried = translate(exc)
    except ImportError:  # pyspark absent: nothing can carry a sparkqueue error
        carried = None
    if carried is not None:
        exc = carried
    lines = [ln.strip().lstrip(": ") for ln in str(exc).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("at ", "An error occurred while calling", "JVM stacktrace"))]
    first = lines[0] if lines else ""
    cause = _python_cause(lines)
    if cause and cause not in first:  # a Python error inside the Spark job (foreachBatch, a task): say which
        first = f"{first[:300]} ... {cause}"
    return f"{type(exc).__name__}: {first[:1000]}"


def _python_cause(lines: list[str]) -> str:
    """The last 'SomeError: message' line of a Python traceback a Spark error carries, or ''."""
    for ln in reversed(lines):
        name, sep, _ = ln.partition(": ")
        if sep and name.replace(".", "").isidentifier() and name.split(".")[-1].endswith(("Error", "Exception")):
            return ln[:600]
    return ""


@contextmanager
def expected_failures(verbose: bool) -> Iterator[None]:
    """Report an expected failure (sparkqueue error, failed Spark job, bad configuration, I/O error) in one line, exit 1.

    A failed Spark job's error carries a JVM stack trace of a hundred lines; the one line says what
    failed, and `--verbose` shows the whole trace.
    """
    failures: tuple[type[BaseException], ...] = (SparkQueueError, OSError, ValueError, KeyError, tomllib.TOMLDecodeError)
    try:  # the consumers' output tables (deltalake): a path that is no table, a schema it refuses
        from deltalake.exceptions import DeltaError

        failures += (DeltaError,)
    except ImportError:
        pass
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException

        failures += (PySparkException, Py4JError)
    except ImportError:
        pass
    try:
        yield
    except KeyboardInterrupt:
        if verbose:
            raise
        logging.getLogger("jobs").error(
            "interrupted: what the run completed stays completed; messages it had locked come back when their locks "
            "expire (queue.lock_duration), and staged files go with the next run's clean-up"
        )
        raise SystemExit(130) from None
    except failures as exc:
        if verbose:
            raise
        logging.getLogger("jobs").error("%s (run with --verbose for the full trace)", summary(exc))
        raise SystemExit(1) from None
