"""The `sparkqueue` command line: manage the entities of a namespace and move their messages."""

import contextlib
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.highlighter import JSONHighlighter
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

import sparkqueue
from sparkqueue import CorrelationRuleFilter, Namespace, ReceivedMessage, SqlRuleAction, SqlRuleFilter
from sparkqueue.cli import ops, render
from sparkqueue.errors import (
    EntityNotFoundError,
    FilterSyntaxError,
    PartitionUnavailableError,
    SessionCannotBeLockedError,
    SparkQueueError,
    StorageCorruptedError,
)
from sparkqueue.model import limits
from sparkqueue.model.addresses import TOPIC
from sparkqueue.model.properties import EntityProperties, QueueProperties, TopicProperties, build_properties
from sparkqueue.receiver import Receiver
from sparkqueue.storage.store import is_local, resolve_root

DEFAULT_ROOT = "./sparkqueue-data"

out = render.console()
err = render.console(stderr=True)


class _App(typer.Typer):
    """A Typer app whose process exit skips native teardown (see `__call__`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the CLI; at exit, flush and leave with os._exit so no native library can abort the process.

        pyarrow and delta-rs worker threads that are still alive while CPython finalizes can end a
        finished process with SIGABRT ("terminate called without an active exception"), rarely and
        under load. All work (Delta commits, output) is done by the time the command returns.
        Only the program entry points (console script, `python -m`) exit this way; a call with
        arguments (`app(["list"])`, in-process use) raises SystemExit as usual.
        """
        if args or set(kwargs) - {"prog_name"}:
            return super().__call__(*args, **kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                err.print(e.code, markup=False, highlight=False)
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)


app = _App(
    name="sparkqueue",
    help="Partitioned queues and topics stored in Delta Lake: manage entities and rules, send, peek, receive, purge, resubmit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
create_app = typer.Typer(help="Create a queue, a topic or a subscription.", no_args_is_help=True)
delete_app = typer.Typer(help="Delete a queue, a topic (with its subscriptions) or a subscription.", no_args_is_help=True)
rule_app = typer.Typer(help="Create, list and delete the rules (filters and actions) of a subscription.", no_args_is_help=True)
app.add_typer(create_app, name="create")
app.add_typer(delete_app, name="delete")
app.add_typer(rule_app, name="rule")

_verbose = False  # --verbose of this invocation: unexpected errors then show their traceback
P = ParamSpec("P")
R = TypeVar("R")


class CliError(Exception):
    """An expected failure of the CLI itself (not of the library): reported in one line, exit code 1."""


class NoNamespaceError(CliError):
    """There is no namespace at the root (yet): only `create` makes one."""


class Tier(StrEnum):
    """Namespace tiers."""

    standard = "standard"
    premium = "premium"


@dataclass
class State:
    """Global options, shared by all commands through the typer context."""

    root: str
    tier: str | None
    verbose: bool = False

    def namespace(self, *, create: bool = False) -> Namespace:
        """Open the namespace; only `create` commands may create a missing local root."""
        if not self.root.strip():
            raise CliError("the namespace root is empty: pass --root PATH or set SPARKQUEUE_ROOT")
        root = resolve_root(self.root)  # a bad root raises InvalidOperationError, reported as any library error
        if is_local(root) and Path(root).exists() and not Path(root).is_dir():
            raise CliError(f"namespace root {self.root!r} is a file, not a directory: pass --root PATH of a directory")
        if not create and is_local(root) and not Path(root).is_dir():
            raise NoNamespaceError(
                f"namespace root {self.root!r} does not exist: pass --root PATH or set SPARKQUEUE_ROOT "
                "(`sparkqueue create ...` creates it)"
            )
        try:
            return Namespace(self.root, tier=self.tier, create=create)  # a read never makes a namespace of any folder
        except EntityNotFoundError:
            raise NoNamespaceError(
                f"there is no sparkqueue namespace at {self.root!r}: pass --root PATH or set SPARKQUEUE_ROOT "
                "(`sparkqueue create ...` creates it)"
            ) from None

    def namespace_to_create_in(self, check: Callable[[str], None]) -> Namespace:
        """The namespace a `create` adds to; when there is none yet, `check(tier)` runs first, so a refused create makes none.

        `check` applies what the library checks of the new entity without a namespace (names, durations,
        sizes, the tier's limits): a namespace, once made, keeps its tier.
        """
        try:
            return self.namespace()
        except NoNamespaceError:
            check(self.tier or limits.STANDARD)
            return self.namespace(create=True)


def fail(message: str) -> NoReturn:
    """Print a one-line error in red on stderr and exit with code 1."""
    err.print(render.safe(f"Error: {message}", style="bold red"), soft_wrap=True)
    raise typer.Exit(1)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn errors into a one-line message and exit code 1: expected ones (sparkqueue's, the CLI's, file I/O) as they
    are, anything else (a value the library could not store, an engine error) named by its type, with the traceback
    under --verbose only. A command never ends in a traceback for a bad argument."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter, SystemExit):
            raise
        except (SparkQueueError, CliError, OSError) as e:
            fail(error_text(e))
        except KeyboardInterrupt:
            err.print(Text("Interrupted", style="yellow"))
            raise typer.Exit(130) from None
        except Exception as e:  # the CLI's last line of defence: one line, not a traceback
            if _verbose:
                raise
            fail(f"{type(e).__name__}: {e} (run with --verbose for the traceback)")

    return wrapper


def error_text(e: Exception) -> str:
    """An error in one line: sparkqueue's and the CLI's as they are, file I/O by its reason, others named by their type."""
    if isinstance(e, (SparkQueueError, CliError)):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    return f"{type(e).__name__}: {e}"


def state(ctx: typer.Context) -> State:
    """The global options of this invocation."""
    obj = ctx.find_object(State)
    assert obj is not None
    return obj


def done(message: str) -> None:
    """A success line on stdout."""
    out.print(render.safe(message, style="green"), soft_wrap=True)


def note(message: str) -> None:
    """A warning line on stderr."""
    err.print(render.safe(message, style="yellow"), soft_wrap=True)


def plain(message: str) -> None:
    """A neutral line on stdout (data in it escaped, never markup)."""
    out.print(render.safe(message), soft_wrap=True)


def print_json(data: Any) -> None:
    """JSON on stdout, unwrapped (colored only on a terminal), with every control character \\u-escaped."""
    text = render.json_text(render.jsonable(data))
    out.print(JSONHighlighter()(Text(text)), soft_wrap=True)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (shown on terminals only); yields an `advance(n)` callback."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task(escape(description), total=total)
        yield lambda n: progress.advance(task, n)


MAX_SECONDS = timedelta.max.total_seconds()


def finite(value: float | None) -> float | None:
    """Option callback: a finite number of seconds (nan and inf are not durations)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a number of seconds")
    return value


def wait_seconds(value: float) -> float:
    """Option callback: a wait of 0 to 3600 seconds (nan is named as such, not as out of range)."""
    value = finite(value) or 0.0
    if not 0 <= value <= 3600:
        raise typer.BadParameter(f"{value:g} is not between 0 and 3600 seconds")
    return value


def seconds(value: float | None) -> timedelta | None:
    """A duration option (seconds) as a timedelta; a value no timedelta holds is a one-line error."""
    if value is None:
        return None
    if not math.isfinite(value) or abs(value) >= MAX_SECONDS:
        raise CliError(f"{value} seconds is not a duration sparkqueue can store")
    duration = timedelta(seconds=value)
    if value and not duration:  # it would be checked as 0 ("must be positive, got 0:00:00") for a positive value
        raise CliError(f"{value} seconds is under a microsecond, the finest duration sparkqueue keeps")
    return duration


def detection_window(duplicate_detection: bool, window: float | None) -> timedelta | None:
    """The --duplicate-window of a create: refused without --duplicate-detection, where it would do nothing."""
    if window is not None and not duplicate_detection:
        raise typer.BadParameter(
            "needs --duplicate-detection (without it no message is checked)", param_hint="'--duplicate-window'"
        )
    return seconds(window)


def given(**settings: Any) -> dict[str, Any]:
    """Only the settings given on the command line, so the library's defaults apply to the rest."""
    return {k: v for k, v in settings.items() if v is not None}


def _version(value: bool) -> None:
    if value:
        out.print(f"sparkqueue {sparkqueue.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    root: Annotated[
        str, typer.Option("--root", envvar="SPARKQUEUE_ROOT", help="Namespace root: a directory or an object-store URI.")
    ] = DEFAULT_ROOT,
    tier: Annotated[
        Tier | None,
        typer.Option(
            "--tier",
            envvar="SPARKQUEUE_TIER",
            help="Tier of a new namespace (standard when not given); an existing one has its own, and the other is refused.",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the library's log (INFO) on stderr.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Partitioned queues and topics stored in Delta Lake."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
        force=True,
    )
    # Without --verbose the library's log stays out of the way: what goes wrong ends the command with its
    # one-line error, and a damage report logged on the way would say it again, wrapped over several lines.
    logging.getLogger("sparkqueue").setLevel(logging.NOTSET if verbose else logging.CRITICAL)
    logging.getLogger("sparkqueue.cli").setLevel(logging.NOTSET if verbose else logging.WARNING)
    global _verbose
    _verbose = verbose
    ctx.obj = State(root, tier.value if tier is not None else None, verbose)


# ---- create / delete / list / show -----------------------------------------------------------------

LockDuration = Annotated[
    float | None, typer.Option(callback=finite, help="Peek-lock duration in seconds (default 60; 1 to 300).")
]
MaxDelivery = Annotated[int | None, typer.Option(help="Deliveries before a message is dead-lettered (default 10).")]
Ttl = Annotated[
    float | None, typer.Option("--ttl", callback=finite, help="Default message time to live in seconds (default: never).")
]
Sessions = Annotated[bool, typer.Option("--sessions", help="Require a session id on every message.")]
NoPartitioning = Annotated[bool, typer.Option("--no-partitioning", help="One partition instead of 16.")]
DupDetection = Annotated[bool, typer.Option("--duplicate-detection", help="Drop messages whose id was seen recently.")]
DupWindow = Annotated[float | None, typer.Option(callback=finite, help="Duplicate detection window in seconds (default 600).")]
MaxSize = Annotated[int | None, typer.Option("--max-size", help="Maximum size per partition in MB (1024 ... 5120).")]
DlOnExpiry = Annotated[bool, typer.Option("--dead-letter-on-expiration", help="Dead-letter expired messages.")]
ForwardTo = Annotated[str | None, typer.Option(help="Forward every message to this queue or topic.")]
ForwardDlTo = Annotated[str | None, typer.Option(help="Forward dead letters to this queue or topic.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


@create_app.command("queue")
@handle_errors
def create_queue(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Queue name.")],
    no_partitioning: NoPartitioning = False,
    lock_duration: LockDuration = None,
    max_delivery_count: MaxDelivery = None,
    duplicate_detection: DupDetection = False,
    duplicate_window: DupWindow = None,
    sessions: Sessions = False,
    ttl: Ttl = None,
    dead_letter_on_expiration: DlOnExpiry = False,
    max_size: MaxSize = None,
    forward_to: ForwardTo = None,
    forward_dead_letters_to: ForwardDlTo = None,
) -> None:
    """Create a queue."""
    settings = {
        "enable_partitioning": not no_partitioning,
        "requires_duplicate_detection": duplicate_detection,
        "requires_session": sessions,
        "dead_lettering_on_message_expiration": dead_letter_on_expiration,
        **given(
            lock_duration=seconds(lock_duration),
            max_delivery_count=max_delivery_count,
            duplicate_detection_history_time_window=detection_window(duplicate_detection, duplicate_window),
            default_message_time_to_live=seconds(ttl),
            max_size_in_megabytes=max_size,
            forward_to=forward_to,
            forward_dead_lettered_messages_to=forward_dead_letters_to,
        ),
    }
    ns = state(ctx).namespace_to_create_in(functools.partial(check_new, QueueProperties, name, settings))
    props = ns.create_queue(name, **settings)
    done(f"Created queue {name!r} ({_partitions(props.partition_count)}).")


@create_app.command("topic")
@handle_errors
def create_topic(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Topic name.")],
    no_partitioning: NoPartitioning = False,
    duplicate_detection: DupDetection = False,
    duplicate_window: DupWindow = None,
    ttl: Ttl = None,
    max_size: MaxSize = None,
) -> None:
    """Create a topic."""
    settings = {
        "enable_partitioning": not no_partitioning,
        "requires_duplicate_detection": duplicate_detection,
        **given(
            duplicate_detection_history_time_window=detection_window(duplicate_detection, duplicate_window),
            default_message_time_to_live=seconds(ttl),
            max_size_in_megabytes=max_size,
        ),
    }
    ns = state(ctx).namespace_to_create_in(functools.partial(check_new, TopicProperties, name, settings))
    props = ns.create_topic(name, **settings)
    done(f"Created topic {name!r} ({_partitions(props.partition_count)}).")


@create_app.command("subscription")
@handle_errors
def create_subscription(
    ctx: typer.Context,
    topic: Annotated[str, typer.Argument(help="Topic name.")],
    name: Annotated[str, typer.Argument(help="Subscription name.")],
    lock_duration: LockDuration = None,
    max_delivery_count: MaxDelivery = None,
    sessions: Sessions = False,
    ttl: Ttl = None,
    dead_letter_on_expiration: DlOnExpiry = False,
    forward_to: ForwardTo = None,
    forward_dead_letters_to: ForwardDlTo = None,
) -> None:
    """Create a subscription of a topic (its rule $Default matches every message)."""
    state(ctx).namespace().create_subscription(
        topic,
        name,
        requires_session=sessions,
        dead_lettering_on_message_expiration=dead_letter_on_expiration,
        **given(
            lock_duration=seconds(lock_duration),
            max_delivery_count=max_delivery_count,
            default_message_time_to_live=seconds(ttl),
            forward_to=forward_to,
            forward_dead_lettered_messages_to=forward_dead_letters_to,
        ),
    )
    done(f"Created subscription {topic}/{name}.")


def check_new(kind: type[EntityProperties], name: str, settings: dict[str, Any], tier: str) -> None:
    """Before a create makes a namespace: the library's checks of the entity's name and settings in `tier`.

    A new namespace holds no entity yet, so no forwarding destination (but the entity itself, for its dead letters) exists.
    """
    limits.check_entity_name(name, kind.entity_type)
    build_properties(kind, name, tier, settings)
    for option, key in (("--forward-to", "forward_to"), ("--forward-dead-letters-to", "forward_dead_lettered_messages_to")):
        to = settings.get(key)
        if to is not None and not (key == "forward_dead_lettered_messages_to" and to.lower() == name.lower()):
            raise EntityNotFoundError(
                f"{option} names {to!r}, but the namespace does not exist yet, so no queue or topic of that name does; "
                "create the destination first (nothing was created)"
            )


def _partitions(n: int) -> str:
    return "1 partition" if n == 1 else f"{n} partitions"


@delete_app.command("queue")
@handle_errors
def delete_queue(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Queue name.")]) -> None:
    """Delete a queue and all its messages."""
    state(ctx).namespace().delete_queue(name)
    done(f"Deleted queue {name!r}.")


@delete_app.command("topic")
@handle_errors
def delete_topic(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Topic name.")]) -> None:
    """Delete a topic with its subscriptions and messages."""
    state(ctx).namespace().delete_topic(name)
    done(f"Deleted topic {name!r} and its subscriptions.")


@delete_app.command("subscription")
@handle_errors
def delete_subscription(
    ctx: typer.Context,
    topic: Annotated[str, typer.Argument(help="Topic name.")],
    name: Annotated[str, typer.Argument(help="Subscription name.")],
) -> None:
    """Delete a subscription and its messages."""
    state(ctx).namespace().delete_subscription(topic, name)
    done(f"Deleted subscription {topic}/{name}.")


@app.command("list")
@handle_errors
def list_entities(
    ctx: typer.Context,
    as_json: AsJson = False,
    counts: Annotated[bool, typer.Option("--counts/--no-counts", help="Read message counts (one table read per entity).")] = True,
) -> None:
    """List queues, and topics with their subscriptions."""
    ns = state(ctx).namespace()
    rows: list[dict[str, Any]] = []

    def row(kind: str, name: str, props: Any, listed: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        r: dict[str, Any] = {"type": kind, "name": name, "partitions": props.partition_count}
        if counts:
            # The list calls: an entity whose table cannot be read is listed as "Unknown", not the listing failed.
            rp = listed().get(name)
            if rp is None:
                return None  # deleted since it was listed
            r.update({k: v for k, v in render.runtime_dict(rp).items() if k != "partitions"})
        return r

    queues = sorted(ns.list_queues(), key=lambda p: p.name)
    topics = sorted(ns.list_topics(), key=lambda p: p.name)
    queue_counts = functools.cache(lambda: _by_name(ns.list_queues_runtime_properties()))
    topic_counts = functools.cache(lambda: _by_name(ns.list_topics_runtime_properties()))
    for q in queues:
        if (r := row("queue", q.name, q, queue_counts)) is not None:
            rows.append(r)
    for t in topics:
        if (r := row("topic", t.name, t, topic_counts)) is None:
            continue
        rows.append(r)
        sub_counts = functools.cache(lambda t=t: _by_name(ns.list_subscriptions_runtime_properties(t.name)))
        for s in sorted(ns.list_subscriptions(t.name), key=lambda p: p.name):
            if (sub := row("subscription", s.name, s, sub_counts)) is not None:
                sub["topic"] = t.name
                rows.append(sub)
    if as_json:
        print_json(
            {
                "queues": [r for r in rows if r["type"] == "queue"],
                "topics": [
                    {**r, "subscriptions": [s for s in rows if s["type"] == "subscription" and s["topic"] == r["name"]]}
                    for r in rows
                    if r["type"] == "topic"
                ],
            }
        )
    elif not rows:
        plain(f"No queues or topics in {state(ctx).root}.")
    else:
        out.print(render.list_table(rows, counts=counts))
        limited = [r for r in rows if counts and not r["counts_complete"]]
        if limited:
            names = ", ".join(r["name"] if r["type"] != "subscription" else f"{r['topic']}/{r['name']}" for r in limited)
            note(f"{render.INCOMPLETE_NOTE} ({names}); `sparkqueue check` reports the damage.")


@app.command()
@handle_errors
def show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Queue, topic, or subscription (TOPIC/SUB or TOPIC/Subscriptions/SUB).")],
    as_json: AsJson = False,
) -> None:
    """Show runtime properties: counts, availability and the per-partition breakdown, with the settings."""
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)
    props = ops.settings(ns, target)
    rp = ops.runtime(ns, target)
    subs: list[tuple[str, Any]] = []
    if target.kind == TOPIC:
        subs = [
            (s.name, ns.get_subscription_runtime_properties(target.name, s.name))
            for s in sorted(ns.list_subscriptions(target.name), key=lambda p: p.name)
        ]
    if as_json:
        data: dict[str, Any] = {
            "type": target.kind,
            "name": target.display,
            "settings": render.settings_dict(props),
            "runtime": render.runtime_dict(rp),
        }
        if target.kind == TOPIC:
            data["subscriptions"] = [
                {"name": n, **{k: v for k, v in render.runtime_dict(srp).items() if k != "partitions"}} for n, srp in subs
            ]
        print_json(data)
    else:
        out.print(render.entity_view(target.kind, target.display, props, rp, subs))
        down = [str(p.partition_id) for p in rp.partitions if not p.available]
        if down or any(not render.counts_complete(srp) for _, srp in subs):
            where = f"partition(s) {', '.join(down)}" if down else "partitions of its subscriptions"
            note(f"{render.INCOMPLETE_NOTE} ({where}); `sparkqueue check` reports the damage.")


# ---- messages ----------------------------------------------------------------------------------------

EntityName = Annotated[str, typer.Argument(help="Queue, or subscription (TOPIC/SUB or TOPIC/Subscriptions/SUB).")]
Session = Annotated[
    str | None, typer.Option(help=f"Session id, for session-enabled entities ('{ops.ANY_SESSION}': the next available).")
]


@app.command()
@handle_errors
def peek(
    ctx: typer.Context,
    name: EntityName,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=1_000_000, help="Messages to show.")] = 10,
    dead_letter: Annotated[bool, typer.Option("--dead-letter", help="Browse the dead-letter sub-queue.")] = False,
    from_sequence: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=2**63 - 1,
            help="Start at the first message numbered this or more (partitions in order: a number's top 16 bits are its "
            "partition), so the last number shown plus 1 gives the next page.",
        ),
    ] = None,
    session: Session = None,
    as_json: AsJson = False,
) -> None:
    """Browse messages without locking or removing them.

    A session entity is browsed session by session (--session), through a session receiver as in the SDK:
    the session is locked while it is browsed, so a session another receiver holds cannot be browsed.
    """
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)
    try:
        msgs = ops.peek(ns, target, count, dead_letter=dead_letter, from_sequence=from_sequence, session=session)
    except SessionCannotBeLockedError as e:
        raise CliError(
            f"cannot peek {target.label}: {e}. Browsing a session takes its lock (a session is browsed through a "
            "session receiver), so peek again once that receiver releases the session"
        ) from None
    after = f" numbered {from_sequence} or more" if from_sequence is not None else ""
    _print_messages(msgs, target, dead_letter, as_json, "Peeked", after)


def _print_messages(
    msgs: list[ReceivedMessage], target: ops.Target, dead_letter: bool, as_json: bool, verb: str, after: str = ""
) -> None:
    if as_json:
        print_json([render.message_dict(m) for m in msgs])
        return
    where = f"{target.label}{' (dead-letter)' if dead_letter else ''}"
    if not msgs:
        plain(f"No messages{after} in {where}.")
        return
    title = f"{verb} {len(msgs)} message(s) from {where}"
    out.print(render.messages_table(msgs, title, width=out.width, dead_letter=dead_letter))


@app.command()
@handle_errors
def send(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Queue or topic.")],
    file: Annotated[
        Path,
        typer.Option("--file", "-f", dir_okay=False, allow_dash=True, help="Input file ('-' for stdin)."),
    ],
    jsonl: Annotated[
        bool,
        typer.Option(
            "--jsonl",
            help=(
                "JSON lines: 'body' (or 'body_base64') and message properties, one object per line; the objects of "
                "peek --json's array send as they are (put one per line: jq -c '.[]'), their extra fields dropped."
            ),
        ),
    ] = False,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="Messages per atomic send.")] = 500,
) -> None:
    """Send one message per non-empty line of a file (or per JSON-lines record with --jsonl); empty lines are skipped.

    A regular file is checked in full before anything is sent; stdin ('-'), a pipe or another stream is read once,
    as it is sent, batch by batch.
    """
    streamed = str(file) == "-" or (file.exists() and not file.is_dir() and not file.is_file())  # a FIFO: one read
    if not streamed and not file.is_file():
        raise typer.BadParameter(f"file {str(file)!r} does not exist or is not a file", param_hint="'--file' / '-f'")
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)
    rules = ops.send_rules(ns, target)
    result = ops.SendResult()
    with ops.sender(ns, target) as s:
        try:
            source = "<stdin>" if str(file) == "-" else str(file)
            # A regular file: everything checked before anything is sent, so a bad line sends nothing.
            total = None if streamed else ops.count_messages(file, jsonl=jsonl, rules=rules)
            with _input(file) as stream, progress_bar(f"Sending to {target.display}", total) as advance:
                checked = None if total is not None else rules  # a regular file was checked in full just above
                ops.send_stream(s, stream, source, jsonl=jsonl, batch=batch, rules=checked, progress=advance, result=result)
        except Exception as e:  # midway: say what was sent, so it is not sent twice
            if not result.read:
                raise
            raise CliError(
                f"{error_text(e)}; the first {result.read} message(s) were already sent to {target.label} and the rest "
                f"were not: do not send those {result.read} again"
            ) from e
    if target.kind == TOPIC:
        # A copy a subscription cannot take (no session id for a session subscription) is stored dead-lettered:
        # the send does not say which, so this says stored, not delivered.
        copies = "1 copy" if result.stored == 1 else f"{result.stored} copies"
        done(f"Sent {result.read} message(s) to {target.label}: its subscriptions stored {copies}.")
        if result.read and not result.stored:
            note("No subscription's rules matched (or the topic has no subscriptions): nothing was stored.")
    else:
        dropped = result.read - result.stored
        extra = f"; {dropped} dropped as duplicates" if dropped else ""
        done(f"Sent {result.read} message(s) to {target.label}{extra}.")


@contextmanager
def _input(file: Path) -> Iterator[Any]:
    """The bytes of --file: stdin for '-', else the file (or pipe) opened for reading."""
    if str(file) == "-":
        yield typer.get_binary_stream("stdin")
        return
    with file.open("rb") as stream:
        yield stream


@app.command()
@handle_errors
def receive(
    ctx: typer.Context,
    name: EntityName,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=1_000_000, help="Messages to receive.")] = 1,
    complete: Annotated[
        bool, typer.Option("--complete/--abandon", help="Complete the messages (remove them), or abandon (release) them.")
    ] = True,
    dead_letter: Annotated[bool, typer.Option("--dead-letter", help="Receive from the dead-letter sub-queue.")] = False,
    wait: Annotated[float, typer.Option(callback=wait_seconds, help="Seconds to wait for the first message (0 to 3600).")] = 1.0,
    session: Session = None,
    as_json: AsJson = False,
) -> None:
    """Receive messages (peek-lock), print them, then complete them (default) or abandon them."""
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)

    def handle(r: Receiver, msgs: list[ReceivedMessage]) -> None:
        # Settled only once the output is out: a reader that went away (a closed pipe) must not cost the messages.
        try:
            _print_messages(msgs, target, dead_letter, as_json, "Received")
            out.file.flush()
        except BaseException as exc:
            r.abandon_messages(msgs)
            if isinstance(exc, (OSError, SystemExit)):  # rich reports a closed pipe as SystemExit(1)
                why = "its reader went away" if isinstance(exc, SystemExit) else error_text(exc)
                raise CliError(f"the output could not be written ({why}): the {len(msgs)} message(s) were abandoned") from None
            raise
        (r.complete_messages if complete else r.abandon_messages)(msgs)

    msgs = ops.receive(ns, target, count, wait=wait, dead_letter=dead_letter, session=session, handle=handle)
    if not msgs:
        _print_messages(msgs, target, dead_letter, as_json, "Received")
    elif not as_json:
        done(f"{'Completed' if complete else 'Abandoned'} {len(msgs)} message(s).")


@app.command()
@handle_errors
def purge(
    ctx: typer.Context,
    name: EntityName,
    dead_letter: Annotated[bool, typer.Option("--dead-letter", help="Purge the dead-letter sub-queue instead.")] = False,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="Messages per receive.")] = 500,
) -> None:
    """Delete all available messages (receive-and-delete in batches)."""
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)
    if target.kind == TOPIC:
        ops.receiver(ns, target)  # raises: topics are purged per subscription
    before = ops.runtime(ns, target)
    total = before.dead_letter_message_count if dead_letter else before.active_message_count
    where = f"{target.label}{' (dead-letter)' if dead_letter else ''}"
    result = ops.PurgeResult()
    try:
        with progress_bar(f"Purging {target.display}", total) as advance:
            ops.purge(ns, target, dead_letter=dead_letter, batch=batch, progress=advance, result=result)
    except Exception as e:  # midway (a damaged partition): say what was deleted before it
        if not result.purged:
            raise
        raise CliError(f"Purged {result.purged} message(s) from {where}; then: {then_text(e)}") from e
    done(f"Purged {result.purged} message(s) from {where}.")
    after = ops.runtime(ns, target)
    left = after.dead_letter_message_count if dead_letter else after.total_message_count - after.dead_letter_message_count
    if left:
        note(f"{left} message(s) remain: scheduled, deferred, locked by a receiver, or sent meanwhile.")


@app.command()
@handle_errors
def resubmit(
    ctx: typer.Context,
    name: EntityName,
    count: Annotated[
        int | None, typer.Option("--count", "-n", min=1, max=2**31 - 1, help="At most this many dead letters.")
    ] = None,
    via_topic: Annotated[
        bool,
        typer.Option(
            "--via-topic", help="For a subscription: resend through its topic (every matching subscription gets a copy)."
        ),
    ] = False,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="Dead letters per receive.")] = 100,
) -> None:
    """Move dead letters back to their queue (or, with --via-topic, a subscription's to its topic)."""
    ns = state(ctx).namespace()
    target = ops.resolve(ns, name)
    result = ops.ResubmitResult(ops.resubmit_destination(ns, target, via_topic=via_topic))
    total = ops.runtime(ns, target).dead_letter_message_count
    if count is not None:
        total = min(total, count)
    try:
        with progress_bar(f"Resubmitting {target.display}", total) as advance:
            ops.resubmit(ns, target, result, limit=count, batch=batch, progress=advance)
    except Exception as e:  # midway: say what was moved before it; the rest were abandoned, so a new run sees them
        if not result.touched:
            raise
        said = " ".join(filter(None, [_resubmitted_text(result), *_resubmit_problems(result, target)]))
        raise CliError(
            f"{said} Then: {then_text(e)}; the dead letters not moved stay in the dead-letter queue (released: "
            "resubmit again to move them)"
        ) from e
    if not result.touched:
        plain(f"No dead letters in {target.label}: nothing to resubmit.")
        return
    if result.resubmitted:
        done(_resubmitted_text(result))
    problems = _resubmit_problems(result, target)
    if problems:
        fail(" ".join(problems))


def _resubmitted_text(result: ops.ResubmitResult) -> str:
    """What was moved, and how ('' when nothing was)."""
    if not result.resubmitted:
        return ""
    how = []
    if result.transactional:
        how.append(f"{result.transactional} in transactions")
    if result.at_least_once:
        how.append(f"{result.at_least_once} sent then completed")
    return f"Resubmitted {result.resubmitted} dead letter(s) to {result.destination.label} ({', '.join(how)})."


def _resubmit_problems(result: ops.ResubmitResult, target: ops.Target) -> list[str]:
    """The dead letters a resubmit left where they were, and why: one sentence per cause."""
    problems = []
    if result.not_accepted:
        whys = []
        if result.dedupe:
            whys.append("dropped by duplicate detection: the id is still in the detection window")
        if result.destination.kind == TOPIC:
            whys.append(f"no subscription of {result.destination.label} stored a copy: none of their rules matched")
        problems.append(
            f"{result.not_accepted} dead letter(s) were not resubmitted ({'; or '.join(whys)}); they stay in the "
            f"dead-letter queue{' (' + str(result.resubmitted) + ' were)' if result.resubmitted else ''}."
        )
    if result.returned:
        problems.append(
            f"{result.returned} resubmitted message(s) came straight back to the dead-letter queue: `sparkqueue peek "
            f"{target.label} --dead-letter` shows why (a rule action that makes the copy invalid, a missing session id, "
            "or a forward_to to a destination that is missing or disabled); fix that, then resubmit again."
        )
    return problems


def then_text(e: Exception) -> str:
    """The error that stopped a command midway; damaged storage with the command that reports it."""
    text = error_text(e)
    if isinstance(e, (PartitionUnavailableError, StorageCorruptedError)) and "sparkqueue check" not in text:
        text += " (see `sparkqueue check`)"
    return text


@app.command()
@handle_errors
def check(
    ctx: typer.Context,
    repair: Annotated[
        bool, typer.Option("--repair", help="Set a torn newest log entry aside and drop references to missing data files.")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Look for damaged storage (torn log entries, missing or unreadable data files); --repair fixes what is safe to fix."""
    ns = state(ctx).namespace()
    findings = ns.check(repair=repair)
    if as_json:
        print_json([{"table": f.table, "problem": f.problem, "repaired": f.repaired} for f in findings])
    for f in findings if not as_json else []:
        out.print(render.safe(f"{'repaired' if f.repaired else 'damaged'}: {f.table}: {f.problem}"))
    left = [f for f in findings if not f.repaired]
    if left:
        hint = "" if repair else "; `sparkqueue check --repair` fixes what is safe"
        fail(f"{len(left)} problem(s) in {state(ctx).root}{hint}.")
    if not as_json:
        done(f"No damage left in {state(ctx).root}." if findings else f"No damage found in {state(ctx).root}.")


# ---- rules -------------------------------------------------------------------------------------------

Topic = Annotated[str, typer.Argument(help="Topic name.")]
Subscription = Annotated[str, typer.Argument(help="Subscription name.")]
RuleName = Annotated[str, typer.Argument(help="Rule name.")]


def property_value(item: str) -> tuple[str, Any]:
    """NAME=VALUE of --property: VALUE as JSON when it is a number, boolean or quoted string, else the text itself."""
    name, sep, raw = item.partition("=")
    if not sep or not name.strip():
        raise CliError(f"--property expects NAME=VALUE, got {item!r}")
    try:
        value = json.loads(raw, parse_constant=lambda c: raw)  # NaN/Infinity stay text
    except (ValueError, RecursionError):
        value = raw
    if not isinstance(value, (str, int, float, bool)):
        value = raw  # objects, arrays and null: compared as the text given
    if isinstance(value, float) and not math.isfinite(value):
        raise CliError(f"--property {item!r}: {raw} is out of range for a number")
    return name.strip(), value


def properties(items: list[str]) -> dict[str, Any]:
    """The --property NAME=VALUE options as a dict; a name given twice is refused (one value per property matches)."""
    props: dict[str, Any] = {}
    for item in items:
        key, value = property_value(item)
        if key in props:
            raise CliError(
                f"--property {key!r} is given twice: a correlation filter matches one value per property "
                f'(for either value, create a rule per value, or use --sql "{key} IN (...)")'
            )
        props[key] = value
    return props


@rule_app.command("create")
@handle_errors
def rule_create(
    ctx: typer.Context,
    topic: Topic,
    subscription: Subscription,
    name: RuleName,
    sql: Annotated[str | None, typer.Option("--sql", help="SQL filter, e.g. \"region = 'eu' AND qty > 10\".")] = None,
    correlation_id: Annotated[str | None, typer.Option(help="Correlation filter: correlation id equals.")] = None,
    message_id: Annotated[str | None, typer.Option(help="Correlation filter: message id equals.")] = None,
    to: Annotated[str | None, typer.Option(help="Correlation filter: 'to' equals.")] = None,
    reply_to: Annotated[str | None, typer.Option(help="Correlation filter: reply-to equals.")] = None,
    subject: Annotated[str | None, typer.Option(help="Correlation filter: subject (label) equals.")] = None,
    session_id: Annotated[str | None, typer.Option(help="Correlation filter: session id equals.")] = None,
    reply_to_session_id: Annotated[str | None, typer.Option(help="Correlation filter: reply-to session id equals.")] = None,
    content_type: Annotated[str | None, typer.Option(help="Correlation filter: content type equals.")] = None,
    prop: Annotated[
        list[str] | None,
        typer.Option(
            "--property",
            "-p",
            help=(
                "Correlation filter: application property NAME=VALUE (repeatable). VALUE is typed as JSON reads it: "
                'qty=20 is the number 20, vip=true a boolean, code=\'"20"\' the string "20" (else the text itself).'
            ),
        ),
    ] = None,
    action: Annotated[
        str | None, typer.Option("--action", help='SQL action applied to matching copies, e.g. "SET x = 1".')
    ] = None,
) -> None:
    """Add a rule to a subscription: a SQL filter (--sql) or a correlation filter (the field options and --property).

    With neither, the rule matches every message. A message is copied to the subscription when any of its rules matches;
    a new subscription has the rule $Default (every message): delete it to keep only what your rules select.
    """
    fields = {
        "correlation_id": correlation_id,
        "message_id": message_id,
        "to": to,
        "reply_to": reply_to,
        "label": subject,
        "session_id": session_id,
        "reply_to_session_id": reply_to_session_id,
        "content_type": content_type,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    props = properties(prop or [])
    if sql is not None and (fields or props):
        raise CliError("give a SQL filter (--sql) or correlation fields (--correlation-id, --property, ...), not both")
    flt: Any = None
    try:
        if sql is not None:
            flt = SqlRuleFilter(sql)
        elif fields or props:
            flt = CorrelationRuleFilter(**fields, properties=props or None)
        rule = (
            state(ctx)
            .namespace()
            .create_rule(topic, subscription, name, filter=flt, action=SqlRuleAction(action) if action is not None else None)
        )
    except FilterSyntaxError as e:  # the library's words name its keyword argument; the command line binds no parameters
        said = str(e).replace("(pass it in parameters=)", "(the command line binds no @parameters: write the value)")
        raise CliError(said) from None
    action = f"; action: {rule.action.sql_expression}" if rule.action is not None else ""
    done(f"Created rule {name!r} on {topic}/{subscription}: {render.filter_text(rule.filter)}{action}.")


@rule_app.command("list")
@handle_errors
def rule_list(ctx: typer.Context, topic: Topic, subscription: Subscription, as_json: AsJson = False) -> None:
    """List the rules of a subscription with their filters and actions."""
    rules = sorted(state(ctx).namespace().list_rules(topic, subscription), key=lambda r: r.name)
    if as_json:
        print_json([render.rule_dict(r) for r in rules])
    elif not rules:
        plain(f"No rules on {topic}/{subscription}: it receives no messages.")
    else:
        out.print(render.rules_table(rules, f"Rules of {topic}/{subscription}"))


@rule_app.command("delete")
@handle_errors
def rule_delete(ctx: typer.Context, topic: Topic, subscription: Subscription, name: RuleName) -> None:
    """Delete a rule of a subscription (quote '$Default' in the shell)."""
    state(ctx).namespace().delete_rule(topic, subscription, name)
    done(f"Deleted rule {name!r} of {topic}/{subscription}.")


def _by_name(listed: list[Any]) -> dict[str, Any]:
    """Runtime properties from a list call, by entity name (`list` looks each entity up once)."""
    return {rp.name: rp for rp in listed}
