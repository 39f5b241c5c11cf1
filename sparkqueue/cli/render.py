"""Rich tables and JSON-ready dicts for the CLI's output."""

import base64
import json
import os
import re
import sys
from datetime import datetime, timedelta
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkqueue import ReceivedMessage
from sparkqueue.model.properties import PartitionRuntimeProperties, RuntimeProperties

# C0 and C1 control characters, DEL, and the Unicode bidirectional overrides (text that reorders what follows it).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # json.dumps escapes C0 itself


PIPED_WIDTH = 160  # columns when output goes to a file or pipe (rich would cut lines and tables at 80)


def console(*, stderr: bool = False) -> Console:
    """A console for the CLI and the jobs: no syntax highlighting of output, and no 80-column cut when piped (a CI log)."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and "COLUMNS" not in os.environ  # COLUMNS, when set, is the user's choice
    return Console(stderr=stderr, highlight=False, width=PIPED_WIDTH if piped else None)


def clean(value: object) -> str:
    """Text safe for a terminal: control characters shown as escapes (\\x1b, \\n), never sent to the terminal."""
    text = value if isinstance(value, str) else str(value)
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def safe(value: object, style: str = "") -> Text:
    """Data (bodies, ids, properties, names) as a rich Text: escaped control characters, never read as markup."""
    return Text(clean(value), style=style)


def json_text(data: Any) -> str:
    """Indented JSON whose strings carry no raw control character: json escapes C0 ones, this the rest (C1, bidi)."""
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


DURATION_SETTINGS = ("lock_duration", "duplicate_detection_history_time_window", "default_message_time_to_live")

COUNT_COLUMNS = (
    ("active_message_count", "Active"),
    ("dead_letter_message_count", "Dead-letter"),
    ("scheduled_message_count", "Scheduled"),
    ("deferred_message_count", "Deferred"),
    ("transfer_message_count", "Transfer"),
    ("transfer_dead_letter_message_count", "Transfer DL"),
    ("total_message_count", "Total"),
)


def human_size(n: int) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


AVAILABLE = "Available"  # availability_status when every partition could be read
INCOMPLETE_NOTE = "Counts marked ≥ are lower bounds: partitions that could not be read are not counted"


def counts_complete(rp: RuntimeProperties) -> bool:
    """Whether every partition was read: an unreadable one adds nothing to the counts (docs/semantics.md §10)."""
    return rp.availability_status == AVAILABLE


def count_text(value: int, complete: bool) -> str:
    """A count for a table: `≥N` when partitions are missing from it (N is then a lower bound)."""
    return str(value) if complete else f"≥{value}"


def _status(available: bool | str) -> Text:
    ok = available is True or available == AVAILABLE
    label = available if isinstance(available, str) else ("OK" if available else "DOWN")
    return Text(label, style="green" if ok else "bold red")


def jsonable(value: Any) -> Any:
    """Timedeltas as seconds, datetimes as ISO-8601, containers recursively."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# ---- messages --------------------------------------------------------------------------------------


def message_dict(m: ReceivedMessage) -> dict[str, Any]:
    """A received or peeked message as a JSON-ready dict (body as text, or body_base64 when not UTF-8)."""
    out: dict[str, Any] = {
        "sequence_number": m.sequence_number,
        "partition_id": m.partition_id,
        "message_id": m.message_id,
        "session_id": m.session_id,
        "partition_key": m.partition_key,
        "state": m.state,
        "delivery_count": m.delivery_count,
        "enqueued_time_utc": _iso(m.enqueued_time_utc),
        "scheduled_enqueue_time_utc": _iso(m.scheduled_enqueue_time_utc),
        "expires_at_utc": _iso(m.expires_at_utc),
        "locked_until_utc": _iso(m.locked_until_utc),
        "time_to_live": m.time_to_live.total_seconds() if m.time_to_live is not None else None,
        "content_type": m.content_type,
        "correlation_id": m.correlation_id,
        "subject": m.subject,
        "to": m.to,
        "reply_to": m.reply_to,
        "reply_to_session_id": m.reply_to_session_id,
        "application_properties": m.application_properties,
        "dead_letter_reason": m.dead_letter_reason,
        "dead_letter_error_description": m.dead_letter_error_description,
        "dead_letter_source": m.dead_letter_source,
        "size_in_bytes": m.size_in_bytes,
    }
    try:
        out["body"] = m.body.decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(m.body).decode("ascii")
    return out


def _body_preview(body: bytes) -> Text:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return Text(f"<{len(body)} bytes, binary>", style="dim")
    return safe(text)


def _fit(avail: int, wants: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """Share `avail` columns among flexible columns given (minimum, natural, weight): weight-proportional, capped."""
    widths = {k: lo for k, (lo, _, _) in wants.items()}
    spare = avail - sum(widths.values())
    while spare > 0:
        open_ = {k: w for k, (_, hi, w) in wants.items() if widths[k] < hi}
        if not open_:
            break
        total = sum(open_.values())
        given = 0
        for k, w in open_.items():
            add = min(max(1, spare * w // total), wants[k][1] - widths[k], spare - given)
            widths[k] += add
            given += add
        if given == 0:
            break
        spare -= given
    return widths


def messages_table(messages: list[ReceivedMessage], title: str, *, width: int, dead_letter: bool = False) -> Table:
    """Messages as a table fitted to `width` (full details with --json); key, state and reason only when they say something."""
    keys = any(m.session_id or m.partition_key for m in messages)
    states = any(m.state != "active" for m in messages)
    bodies = [_body_preview(m.body) for m in messages]
    reasons = [_reason(m) for m in messages]
    fixed: list[tuple[str, int]] = [("Seq", max(len(str(m.sequence_number)) for m in messages)), ("P", 2)]
    fixed += [("Enqueued (UTC)", 19), ("Dlv", 3)] + ([("State", 9)] if states else [])
    wants: dict[str, tuple[int, int, int]] = {"Message ID": (8, max(len(clean(m.message_id)) for m in messages), 3)}
    if keys:
        wants["Key"] = (6, max(len(clean(m.session_id or m.partition_key or "")) for m in messages), 1)
    if dead_letter:
        wants["Reason"] = (6, max(max(len(clean(r)) for r in reasons), 6), 2)
    wants["Body"] = (8, max(max(len(b) for b in bodies), 4), 4)
    gaps = 2 * (len(fixed) + len(wants)) + 1
    fitted = _fit(width - gaps - sum(w for _, w in fixed), wants)

    table = Table(title=safe(title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name, w in fixed:
        table.add_column(name, justify="left" if name in ("Enqueued (UTC)", "State") else "right", no_wrap=True, min_width=w)
    for name in ("Message ID", "Key", "Reason"):
        if name in fitted:
            table.add_column(name, no_wrap=True, overflow="ellipsis", width=fitted[name])
    table.add_column("Body", no_wrap=True, overflow="ellipsis", width=fitted["Body"])
    for m, body, reason in zip(messages, bodies, reasons, strict=True):
        row: list[RenderableType] = [
            str(m.sequence_number),
            str(m.partition_id),
            m.enqueued_time_utc.strftime("%Y-%m-%d %H:%M:%S"),
            str(m.delivery_count),
        ]
        if states:
            row.append(safe(m.state))
        row.append(safe(m.message_id))
        if keys:
            row.append(safe(m.session_id or m.partition_key or ""))
        if dead_letter:
            row.append(safe(reason))
        row.append(body)
        table.add_row(*row)
    return table


def _reason(m: ReceivedMessage) -> str:
    reason = m.dead_letter_reason or ""
    if m.dead_letter_error_description:
        reason = f"{reason}: {m.dead_letter_error_description}" if reason else m.dead_letter_error_description
    return reason


# ---- entities --------------------------------------------------------------------------------------


def runtime_dict(rp: RuntimeProperties) -> dict[str, Any]:
    """Runtime properties as a JSON-ready dict, with the partition breakdown."""
    out: dict[str, Any] = {field: getattr(rp, field) for field, _ in COUNT_COLUMNS}
    out["size_in_bytes"] = rp.size_in_bytes
    out["availability_status"] = rp.availability_status
    out["counts_complete"] = counts_complete(rp)  # False: a partition could not be read, the counts are lower bounds
    if rp.subscription_count is not None:
        out["subscription_count"] = rp.subscription_count
    out["created_at_utc"] = _iso(rp.created_at_utc)
    out["updated_at_utc"] = _iso(rp.updated_at_utc)
    out["partitions"] = [partition_dict(p) for p in rp.partitions]
    return out


def partition_dict(p: PartitionRuntimeProperties) -> dict[str, Any]:
    """One partition's counts."""
    out: dict[str, Any] = {"partition_id": p.partition_id, "available": p.available}
    out.update({field: getattr(p, field) for field, _ in COUNT_COLUMNS})
    out["size_in_bytes"] = p.size_in_bytes
    return out


def settings_dict(props: Any) -> dict[str, Any]:
    """An entity's settings as a JSON-ready dict (durations in seconds), without its name."""
    out = dict(props.settings())
    out.pop("name", None)
    return out


def _setting_text(key: str, value: Any) -> str:
    if value is None:
        return "never" if "time_to_live" in key else "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and key in DURATION_SETTINGS:
        return str(timedelta(seconds=value))
    return str(value)


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True)
    return grid


SETTING_LABELS = {
    "enable_partitioning": "Partitioned",
    "max_size_in_megabytes": "Max size (MB/partition)",
    "requires_duplicate_detection": "Duplicate detection",
    "duplicate_detection_history_time_window": "Detection window",
    "requires_session": "Sessions",
    "lock_duration": "Lock duration",
    "max_delivery_count": "Max delivery count",
    "default_message_time_to_live": "Default TTL",
    "dead_lettering_on_message_expiration": "Dead-letter on expiry",
    "forward_to": "Forward to",
    "forward_dead_lettered_messages_to": "Forward dead letters to",
    "topic_name": "Topic",
}
PARTITION_COLUMNS = (
    ("active_message_count", "Active"),
    ("dead_letter_message_count", "DLQ"),
    ("scheduled_message_count", "Sched."),
    ("deferred_message_count", "Defer."),
    ("transfer_message_count", "Transf."),
    ("total_message_count", "Total"),
)


def entity_view(
    kind: str, display: str, props: Any, rp: RuntimeProperties, subscriptions: list[tuple[str, RuntimeProperties]]
) -> Group:
    """`show`: counts beside settings, the per-partition breakdown, and (topics) the subscriptions."""
    complete = counts_complete(rp)
    counts = _grid()
    counts.add_row("Availability", _status(rp.availability_status))
    counts.add_row("Partitions", str(len(rp.partitions)))
    for field, label in COUNT_COLUMNS:
        counts.add_row(label, count_text(getattr(rp, field), complete))
    counts.add_row("Size", human_size(rp.size_in_bytes) if complete else f"≥{human_size(rp.size_in_bytes)}")
    if rp.subscription_count is not None:
        counts.add_row("Subscriptions", str(rp.subscription_count))
    if rp.created_at_utc is not None:
        counts.add_row("Created (UTC)", rp.created_at_utc.strftime("%Y-%m-%d %H:%M:%S"))
    if rp.updated_at_utc is not None:
        counts.add_row("Updated (UTC)", rp.updated_at_utc.strftime("%Y-%m-%d %H:%M:%S"))
    conf = _grid()
    for key, value in settings_dict(props).items():
        conf.add_row(SETTING_LABELS.get(key, key.replace("_", " ").capitalize()), safe(_setting_text(key, value)))
    summary = Table.grid(padding=(0, 4))
    summary.add_row(counts, conf)

    parts = Table(title="Partitions", title_justify="left")
    parts.add_column("P", justify="right")
    parts.add_column("Status", no_wrap=True)
    for _, label in PARTITION_COLUMNS:
        parts.add_column(label, justify="right")
    parts.add_column("Size", justify="right", no_wrap=True)
    for p in rp.partitions:
        row: list[RenderableType] = [str(p.partition_id), _status(p.available)]
        row += [str(getattr(p, f)) if p.available else "?" for f, _ in PARTITION_COLUMNS]  # unread: unknown
        row.append(human_size(p.size_in_bytes) if p.available else "?")
        parts.add_row(*row)

    items: list[RenderableType] = [safe(f"{kind.capitalize()} {display}", style="bold cyan"), summary, Text(""), parts]
    if subscriptions:
        subs = Table(title="Subscriptions", title_justify="left")
        subs.add_column("Subscription", no_wrap=True)
        subs.add_column("Active", justify="right")
        subs.add_column("DLQ", justify="right")
        subs.add_column("Total", justify="right")
        subs.add_column("Status", no_wrap=True)
        for name, srp in subscriptions:
            complete = counts_complete(srp)
            subs.add_row(
                safe(name),
                count_text(srp.active_message_count, complete),
                count_text(srp.dead_letter_message_count, complete),
                count_text(srp.total_message_count, complete),
                _status(srp.availability_status),
            )
        items.append(subs)
    return Group(*items)


def list_table(rows: list[dict[str, Any]], *, counts: bool) -> Table:
    """`list`: queues, topics and (indented under their topic) subscriptions."""
    table = Table(title="Entities", title_justify="left")
    table.add_column("Type", no_wrap=True)
    table.add_column("Name", no_wrap=True)
    table.add_column("Parts", justify="right")
    if counts:
        table.add_column("Active", justify="right")
        table.add_column("DLQ", justify="right")
        table.add_column("Total", justify="right")
        table.add_column("Status", no_wrap=True)
    for r in rows:
        sub = r["type"] == "subscription"
        row: list[RenderableType] = [
            Text(r["type"], style="dim" if sub else ""),
            safe(("  └ " if sub else "") + r["name"]),
            str(r["partitions"]),
        ]
        if counts:
            complete = r["counts_complete"]
            row += [
                count_text(r["active_message_count"], complete),
                count_text(r["dead_letter_message_count"], complete),
                count_text(r["total_message_count"], complete),
                _status(r["availability_status"]),
            ]
        table.add_row(*row)
    return table


# ---- rules -----------------------------------------------------------------------------------------


OPTION_FIELDS = {"label": "subject"}  # correlation fields the command line names otherwise (rule create --subject)


def filter_text(flt: Any) -> str:
    """A rule filter in one line: its SQL, or its correlation fields and properties."""
    name = type(flt).__name__
    if name in ("TrueRuleFilter", "FalseRuleFilter"):
        return "TRUE" if name == "TrueRuleFilter" else "FALSE"
    if hasattr(flt, "sql_expression"):
        return str(flt.sql_expression)
    fields = {
        OPTION_FIELDS.get(k, k): v for k, v in rule_filter_dict(flt).items() if k not in ("type", "properties") and v is not None
    }
    pairs = [*fields.items(), *(getattr(flt, "properties", None) or {}).items()]
    return " AND ".join(f"{k} = {json_text(jsonable(v))}" for k, v in pairs)  # typed values shown as --json shows them


def rule_filter_dict(flt: Any) -> dict[str, Any]:
    """A rule filter as a JSON-ready dict."""
    name = type(flt).__name__
    if hasattr(flt, "sql_expression"):
        return {"type": name, "sql_expression": flt.sql_expression, "parameters": getattr(flt, "parameters", None)}
    fields = ("correlation_id", "message_id", "to", "reply_to", "label", "session_id", "reply_to_session_id", "content_type")
    out: dict[str, Any] = {"type": name, **{f: getattr(flt, f, None) for f in fields}}
    out["properties"] = getattr(flt, "properties", None)
    return out


def rule_dict(rule: Any) -> dict[str, Any]:
    """A rule (name, filter, action) as a JSON-ready dict."""
    action = rule.action
    return {
        "name": rule.name,
        "filter": rule_filter_dict(rule.filter),
        "action": {"sql_expression": action.sql_expression} if action is not None else None,
    }


def rules_table(rules: list[Any], title: str) -> Table:
    """`rule list`: one row per rule."""
    table = Table(title=safe(title), title_justify="left")
    table.add_column("Rule", no_wrap=True)
    table.add_column("Kind", no_wrap=True)
    table.add_column("Filter")
    table.add_column("Action")
    for r in rules:
        kind = "correlation" if not hasattr(r.filter, "sql_expression") else "sql"
        action = r.action.sql_expression if r.action is not None else ""
        table.add_row(safe(r.name), kind, safe(filter_text(r.filter)), safe(action))
    return table
