"""Validation of names, sizes, durations and entity settings, with the contract's limits (docs/semantics.md §1, §2).

Every value the public API accepts is checked here against the range it is stored and computed in
(int64 sequence numbers and counts, microsecond timestamps up to the year 9999, strict JSON), so an
accepted value can never make a later read, computation or namespace-wide job fail.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, StorageCorruptedError
from sparkqueue.storage.schema import TIMESTAMP

STANDARD = "standard"
PREMIUM = "premium"
TIERS = (STANDARD, PREMIUM)

PARTITION_COUNT = 16
MAX_KEY_LENGTH = 128
MAX_MESSAGE_BYTES = {STANDARD: 256 * 1024, PREMIUM: 100 * 1024 * 1024}
# A batch is one Delta commit, not an AMQP frame: create_message_batch(max_size_in_bytes) may ask for up to this.
MAX_BATCH_BYTES = 256 * 1024 * 1024
SIZES_MB = {STANDARD: (1024, 2048, 3072, 4096, 5120), PREMIUM: (1024, 2048, 3072, 4096, 5120, 10240, 20480, 40960, 81920)}
MAX_PARTITIONED_ENTITIES = 100
MAX_ENTITIES = 10_000
MAX_LOCK_DURATION = timedelta(minutes=5)
# A shorter lock expires before a settle can land (every settle then loses its lock). Service Bus's portal
# allows 5 s; 1 s is kept so that drills and tests can let locks lapse quickly.
MIN_LOCK_DURATION = timedelta(seconds=1)
DEDUPE_WINDOW_RANGE = (timedelta(seconds=20), timedelta(days=7))
MAX_TRANSACTION_MESSAGES = 100
INT64_MAX = 2**63 - 1
MAX_DEAD_LETTER_TEXT = 4096  # Service Bus: DeadLetterReason and DeadLetterErrorDescription, in characters
MAX_USER_METADATA = 1024  # Service Bus: user_metadata of an entity, in characters
# A rule's names and values (correlation fields and properties, parameters), in characters: a SQL expression, and so
# any literal in it, is at most 1,024 (Service Bus); and its whole stored description, in bytes (management._check_description).
MAX_RULE_TEXT = 1024
MAX_RULE_BYTES = 64 * 1024
# Service Bus's quotas per topic: subscriptions, and rules by filter kind (true and false filters are SQL filters).
MAX_SUBSCRIPTIONS_PER_TOPIC = 2000
MAX_SQL_FILTERS_PER_TOPIC = 2000
MAX_CORRELATION_FILTERS_PER_TOPIC = 100_000
# Service Bus's "infinite" TTL is TimeSpan.MaxValue (10,675,199 days and change): a TTL of at least
# 10,675,199 days, timedelta.max included, means "never expires" and is stored as such.
TTL_NEVER = timedelta(days=10_675_199)
# The shortest TTL: TTLs are stored in whole milliseconds, so a shorter one would be 0 (expired on arrival).
MIN_TTL_US = 1000
TTL_TOO_SHORT = "must be at least 1 millisecond (it is kept in whole milliseconds)"  # every send path's words (check_ttl)
# The latest instant stored and computed: the end of the year 9999 at millisecond precision (table
# statistics hold milliseconds and round up); later scheduled times are read as this one.
LATEST_TIME = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
LATEST_US = (LATEST_TIME - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)  # the same, as epoch microseconds

# \Z, not $: "$" also matches before a final newline, which would let "abc\n" through.
RESERVED_SEGMENTS = ("subscriptions", "rules")  # path segments of subscriptions and rules (model/addresses.py)
_ENTITY_NAME = re.compile(r"\A[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,258}[A-Za-z0-9])?\Z")
_CHILD_NAME = re.compile(r"\A[A-Za-z0-9$](?:[A-Za-z0-9._-]{0,48}[A-Za-z0-9])?\Z")


def check_tier(tier: str) -> str:
    """Return the tier, or raise for an unknown one."""
    if tier not in TIERS:
        raise InvalidOperationError(f"tier must be one of {TIERS}, got {tier!r}")
    return tier


def namespace_tier(root: str, recorded: object, asked: str | None) -> str:
    """The tier a namespace was created with; opening it as another tier is refused (its limits would not hold)."""
    if recorded is None:  # made before the marker recorded the tier
        return asked or STANDARD
    if recorded not in TIERS:
        raise StorageCorruptedError(f"namespace {root}: its marker records an unknown tier {recorded!r}")
    if asked is not None and asked != recorded:
        raise InvalidOperationError(f"namespace {root} is a {recorded} namespace; open it as {recorded}, or name no tier")
    return str(recorded)


def check_name_type(name: object, what: str = "queue") -> str:
    """A name given to look an entity up: a str (TypeError otherwise, as in the SDK), not empty, with a UTF-8 form (ValueError).

    No entity can have a name with lone surrogates (what sys.argv makes of undecodable bytes): the catalog stores UTF-8.
    Nor one holding '|', which joins a subscription's or rule's name parts in the catalog (model/addresses.py): it is
    refused here, as an empty name is, so the error names what was asked for, not the parts the catalog would read out of it.
    """
    if not isinstance(name, str):
        raise InvalidArgumentTypeError(f"{what} name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidOperationError(f"{what} name must not be empty")
    if "|" in name:
        raise InvalidOperationError(f"invalid {what} name {name!r}: names cannot contain '|'")
    return check_utf8(name, f"{what} name {name!r}")


def check_entity_name(name: object, what: str = "queue") -> str:
    """Queue and topic names: 1-260 letters, digits, '.', '-', '_', '/', starting and ending alphanumeric."""
    check_name_type(name, what)
    if not isinstance(name, str) or not _ENTITY_NAME.match(name) or "//" in name:
        raise InvalidOperationError(
            f"invalid {what} name {name!r}: use 1-260 letters, digits, '.', '-', '_' or '/', "
            "starting and ending with a letter or digit"
        )
    if any(segment.lower() in RESERVED_SEGMENTS for segment in name.split("/")[1:]):
        raise InvalidOperationError(
            f"invalid {what} name {name!r}: 'Subscriptions' and 'Rules' are reserved after a '/' "
            "(a subscription's path is '<topic>/Subscriptions/<name>')"
        )
    return name


def check_child_name(name: object, what: str = "subscription") -> str:
    """Subscription and rule names: 1-50 letters, digits, '.', '-', '_' (no '/')."""
    check_name_type(name, what)
    if not isinstance(name, str) or not _CHILD_NAME.match(name):
        raise InvalidOperationError(
            f"invalid {what} name {name!r}: use 1-50 letters, digits, '.', '-' or '_', starting and ending with a letter or digit"
        )
    return name


def as_id_string(value: object, field: str) -> str | None:
    """An id as the SDK accepts it (str or uuid.UUID), read back as str; None stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, uuid.UUID):
        return str(value)
    raise InvalidArgumentTypeError(f"{field} must be a str or a uuid.UUID, got {type(value).__name__}")


def check_utf8(value: str, field: str) -> str:
    """A str that has a UTF-8 form (no lone surrogates), as every stored string must."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOperationError(f"{field} contains characters with no UTF-8 form (lone surrogates)") from None
    return value


def check_key(value: object, field: str) -> str | None:
    """message_id, session_id, partition_key: None or a string of at most 128 characters (a UUID is read as str)."""
    value = as_id_string(value, field)
    if value is None:
        return None
    check_utf8(value, field)
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidOperationError(f"{field} is {len(value)} characters long; at most {MAX_KEY_LENGTH} are allowed")
    return value


_ISO_DURATION = re.compile(
    r"\A(?P<sign>-)?P(?:(?P<w>\d+(?:\.\d+)?)W)?(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?\Z"
)


def parse_iso_duration(text: str, field: str) -> timedelta:
    """An ISO 8601 duration ("PT13S", "P1DT2H", "P10675199DT2H48M5.4775807S") as the SDK accepts it."""
    m = _ISO_DURATION.match(text.strip().upper())
    if m is None or text.strip().upper() in ("P", "PT") or text.strip().upper().endswith("T"):
        raise InvalidOperationError(f"{field} must be a timedelta or an ISO 8601 duration such as 'PT30S', got {text!r}")
    parts = {k: float(v) for k, v in m.groupdict().items() if k != "sign" and v is not None}
    days = parts.get("w", 0.0) * 7 + parts.get("d", 0.0)
    seconds = parts.get("h", 0.0) * 3600 + parts.get("m", 0.0) * 60 + parts.get("s", 0.0)
    try:
        value = timedelta(days=days, seconds=seconds)
    except OverflowError:
        value = timedelta.max  # beyond what a timedelta holds: longer than any limit, clamped below
    return -value if m.group("sign") else value


def as_timedelta(value: object, field: str) -> object:
    """A duration given as an ISO 8601 string becomes a timedelta; anything else is returned as is."""
    return parse_iso_duration(value, field) if isinstance(value, str) else value


def check_duration(
    value: object, field: str, *, minimum: timedelta = timedelta(0), maximum: timedelta | None = None, allow_none: bool = False
) -> timedelta | None:
    """A timedelta (or ISO 8601 string) within (minimum, maximum]; None only where the setting allows 'never'."""
    if value is None and allow_none:
        return None
    value = as_timedelta(value, field)
    if not isinstance(value, timedelta):
        raise InvalidArgumentTypeError(f"{field} must be a datetime.timedelta, got {type(value).__name__}")
    # A plain timedelta, to the microsecond as stored: pandas' Timedelta holds nanoseconds, and 1 ns would pass as positive.
    value = timedelta(days=value.days, seconds=value.seconds, microseconds=value.microseconds)
    if value <= minimum and minimum == timedelta(0):
        raise InvalidOperationError(f"{field} must be positive, got {show_duration(value)}")
    if value < minimum:
        raise InvalidOperationError(f"{field} must be at least {minimum}, got {show_duration(value)}")
    if maximum is not None and value > maximum:
        raise InvalidOperationError(f"{field} must be at most {maximum}, got {show_duration(value)}")
    return value


def show_duration(value: timedelta) -> str:
    """A duration for an error message: negative ones as "-0:00:05", not Python's "-1 day, 23:59:55"."""
    return f"-{-value}" if value < timedelta(0) else str(value)


def check_ttl(value: object, field: str) -> timedelta | None:
    """A time to live: positive; None, or at least Service Bus's infinite 10,675,199 days, means never expires (None)."""
    ttl = check_duration(value, field, allow_none=True)
    if ttl is not None and ttl >= TTL_NEVER:
        return None
    if ttl is not None and ttl < timedelta(microseconds=MIN_TTL_US):  # stored in whole milliseconds (ttl_ms): it would be 0
        raise InvalidOperationError(f"{field} {TTL_TOO_SHORT}, got {ttl}")
    return ttl


def expiries(at: Any, ttl_ms: Any) -> Any:
    """`at` + TTL (timestamps, milliseconds: arrays or a scalar TTL); null without a TTL or past the latest storable instant.

    The one expiry rule of every send, transaction commit, topic copy and rule action (message.message_rows,
    model/entity.py, model/topics.py).
    """
    at_us = at.cast(pa.int64())
    room_ms = pc.divide(pc.subtract(pa.scalar(LATEST_US, pa.int64()), at_us), 1000)
    fits = pc.fill_null(pc.less_equal(ttl_ms, room_ms), False)
    total = pc.add(at_us, pc.multiply(ttl_ms, 1000))  # wraps where it does not fit: masked out below
    return pc.if_else(fits, total, pa.scalar(None, pa.int64())).cast(TIMESTAMP)


def visible_at(scheduled: Any, now: datetime) -> Any:
    """When messages sent `now` become visible, and count as enqueued: at their scheduled time when that is later, else now.

    The one rule of every send and of a transaction's commit (message.message_rows, model/entity.py).
    """
    now_s = pa.scalar(now, TIMESTAMP)
    return pc.if_else(pc.fill_null(pc.greater(scheduled, now_s), False), scheduled, now_s)


def ttl_ms(ttl: timedelta | None) -> int | None:
    """A TTL in whole milliseconds, as stored (fits int64 for every accepted TTL)."""
    return None if ttl is None else ttl // timedelta(milliseconds=1)


def check_int(value: object, field: str, minimum: int = 1, maximum: int = INT64_MAX) -> int:
    """An int (not bool) in [minimum, maximum] (by default at most the int64 maximum every count is stored in)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentTypeError(f"{field} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidOperationError(f"{field} must be at least {minimum}, got {value}")
    if value > maximum:
        raise InvalidOperationError(f"{field} must be at most {maximum}, got {value}")
    return value


def check_sequence_number(value: object, field: str = "sequence_numbers") -> int:
    """A sequence number: an int in the int64 range sequence numbers are stored in."""
    return check_int(value, field, minimum=0)


def check_sequence_numbers(value: object) -> list[int]:
    """One sequence number or an iterable of them (the SDK's `sequence_numbers` argument: a list, set, generator ...)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, Iterable)):
        raise InvalidArgumentTypeError(f"sequence_numbers must be an int or a list of int, got {type(value).__name__}")
    seqs = [value] if isinstance(value, int) else list(value)
    return [check_sequence_number(s) for s in seqs]


def check_seconds(value: object, field: str, *, allow_zero: bool = False) -> float:
    """A finite positive number of seconds (a timedelta is accepted); NaN, infinity and booleans are refused."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentTypeError(f"{field} must be a number of seconds or a timedelta, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise InvalidOperationError(f"{field} must be a finite number of seconds greater than 0, got {value!r}")
    if value > TTL_NEVER.total_seconds():
        raise InvalidOperationError(f"{field} must be at most {TTL_NEVER.total_seconds():.0f} seconds, got {value!r}")
    return float(value)


def check_text(value: object, field: str, maximum: int) -> str | None:
    """None or a str of at most `maximum` characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{field} must be a str, got {type(value).__name__}")
    if len(value) > maximum:
        raise InvalidOperationError(f"{field} is {len(value)} characters long; at most {maximum} are allowed")
    return check_utf8(value, field)


def check_bool(value: object, field: str) -> bool:
    """A real bool: a flag given as "false" or 1 is refused, never read by its truth."""
    if not isinstance(value, bool):
        kind = type(value)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"  # numpy.bool
        raise InvalidArgumentTypeError(f"{field} must be a bool, got {name}")
    return value


def check_size_mb(value: object, tier: str) -> int:
    """max_size_in_megabytes: an int (as check_int: 1024.0 would be stored as a float), one of the tier's allowed sizes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentTypeError(f"max_size_in_megabytes must be an int, got {type(value).__name__}")
    if value not in SIZES_MB[tier]:
        raise InvalidOperationError(f"max_size_in_megabytes must be one of {SIZES_MB[tier]} in the {tier} tier, got {value!r}")
    return int(value)


def check_application_properties(props: object) -> dict[str, Any] | None:
    """Application properties: str keys; str, int, float, bool or None values (stored as strict JSON).

    bytes keys (as the SDK hands back received properties) are read as UTF-8; integers must fit
    int64 and floats must be finite (NaN and Infinity have no strict-JSON form).
    """
    if props is None:
        return None
    if not isinstance(props, dict):
        raise InvalidArgumentTypeError(f"application_properties must be a dict, got {type(props).__name__}")
    out: dict[str, Any] = {}
    for k, v in props.items():
        if isinstance(k, (bytes, bytearray)):
            try:
                k = bytes(k).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidOperationError(f"application property name {k!r} is not UTF-8") from None
        if not isinstance(k, str):
            raise InvalidOperationError(f"application property names must be str, got {k!r}")
        if k in out:  # {b"k": 1, "k": 2}: one value would be dropped without a word
            raise InvalidOperationError(f"application property {k!r} is given twice (as str and as bytes)")
        check_utf8(k, "application property name")
        if isinstance(v, str):
            check_utf8(v, f"application property {k!r}")
        if isinstance(v, (bytes, bytearray)):
            raise InvalidOperationError(f"application property {k!r} has a bytes value; use str, int, float, bool or None")
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise InvalidOperationError(
                f"application property {k!r} has a {type(v).__name__} value; use str, int, float, bool or None"
            )
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidOperationError(f"application property {k!r} is {v!r}; NaN and infinities cannot be stored")
        if isinstance(v, int) and not isinstance(v, bool) and not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise InvalidOperationError(f"application property {k!r} is outside the int64 range")
        out[k] = v
    return out


def wait_seconds(value: float | timedelta | None, field: str) -> float:
    """max_wait_time as seconds: None means do not wait; 0, negative, NaN or infinite raise ValueError as in the SDK."""
    if value is None:
        return 0.0
    return check_seconds(value, field)
