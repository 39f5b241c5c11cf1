"""Validation of names, sizes, durations and entity settings, with the contract's limits (SPEC §1, §2)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from sparkqueue.errors import InvalidOperationError

STANDARD = "standard"
PREMIUM = "premium"
TIERS = (STANDARD, PREMIUM)

PARTITION_COUNT = 16
MAX_KEY_LENGTH = 128
MAX_MESSAGE_BYTES = {STANDARD: 256 * 1024, PREMIUM: 100 * 1024 * 1024}
SIZES_MB = {STANDARD: (1024, 2048, 3072, 4096, 5120), PREMIUM: (1024, 2048, 3072, 4096, 5120, 10240, 20480, 40960, 81920)}
MAX_PARTITIONED_ENTITIES = 100
MAX_ENTITIES = 10_000
MAX_LOCK_DURATION = timedelta(minutes=5)
DEDUPE_WINDOW_RANGE = (timedelta(seconds=20), timedelta(days=7))
MAX_TRANSACTION_MESSAGES = 100

_ENTITY_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,258}[A-Za-z0-9])?$")
_CHILD_NAME = re.compile(r"^[A-Za-z0-9$](?:[A-Za-z0-9._-]{0,48}[A-Za-z0-9])?$")


def check_tier(tier: str) -> str:
    """Return the tier, or raise for an unknown one."""
    if tier not in TIERS:
        raise InvalidOperationError(f"tier must be one of {TIERS}, got {tier!r}")
    return tier


def check_entity_name(name: object, what: str = "queue") -> str:
    """Queue and topic names: 1-260 letters, digits, '.', '-', '_', '/', starting and ending alphanumeric."""
    if not isinstance(name, str) or not _ENTITY_NAME.match(name) or "//" in name:
        raise InvalidOperationError(
            f"invalid {what} name {name!r}: use 1-260 letters, digits, '.', '-', '_' or '/', "
            "starting and ending with a letter or digit"
        )
    return name


def check_child_name(name: object, what: str = "subscription") -> str:
    """Subscription and rule names: 1-50 letters, digits, '.', '-', '_' (no '/')."""
    if not isinstance(name, str) or not _CHILD_NAME.match(name):
        raise InvalidOperationError(
            f"invalid {what} name {name!r}: use 1-50 letters, digits, '.', '-' or '_', starting and ending with a letter or digit"
        )
    return name


def check_key(value: object, field: str) -> str | None:
    """message_id, session_id, partition_key: None or a string of at most 128 characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidOperationError(f"{field} must be a str, got {type(value).__name__}")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidOperationError(f"{field} is {len(value)} characters long; at most {MAX_KEY_LENGTH} are allowed")
    return value


def check_duration(
    value: object, field: str, *, minimum: timedelta = timedelta(0), maximum: timedelta | None = None, allow_none: bool = False
) -> timedelta | None:
    """A timedelta within (minimum, maximum]; None only where the setting allows 'never'."""
    if value is None and allow_none:
        return None
    if not isinstance(value, timedelta):
        raise InvalidOperationError(f"{field} must be a datetime.timedelta, got {type(value).__name__}")
    if value <= minimum and minimum == timedelta(0):
        raise InvalidOperationError(f"{field} must be positive, got {value}")
    if value < minimum:
        raise InvalidOperationError(f"{field} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidOperationError(f"{field} must be at most {maximum}, got {value}")
    return value


def check_int(value: object, field: str, minimum: int = 1) -> int:
    """An int (not bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOperationError(f"{field} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidOperationError(f"{field} must be at least {minimum}, got {value}")
    return value


def check_bool(value: object, field: str) -> bool:
    """A real bool."""
    if not isinstance(value, bool):
        raise InvalidOperationError(f"{field} must be a bool, got {type(value).__name__}")
    return value


def check_size_mb(value: object, tier: str) -> int:
    """max_size_in_megabytes: one of the tier's allowed sizes."""
    if isinstance(value, bool) or value not in SIZES_MB[tier]:
        raise InvalidOperationError(f"max_size_in_megabytes must be one of {SIZES_MB[tier]} in the {tier} tier, got {value!r}")
    return int(value)  # type: ignore[arg-type]


def check_application_properties(props: object) -> dict[str, Any] | None:
    """Application properties: str keys; str, int, float, bool or None values (stored as typed JSON)."""
    if props is None:
        return None
    if not isinstance(props, dict):
        raise InvalidOperationError(f"application_properties must be a dict, got {type(props).__name__}")
    for k, v in props.items():
        if not isinstance(k, str):
            raise InvalidOperationError(f"application property names must be str, got {k!r}")
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise InvalidOperationError(
                f"application property {k!r} has a {type(v).__name__} value; use str, int, float, bool or None"
            )
    return props
