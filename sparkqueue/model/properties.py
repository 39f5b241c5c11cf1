"""Entity settings and runtime properties, with the azure-servicebus administration client's attribute names."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar, Self

from sparkqueue.constants import EntityStatus
from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, MessagingEntityDisabledError
from sparkqueue.model import limits

NEVER = None  # default_message_time_to_live: messages never expire


@dataclass
class EntityProperties:
    """Common base: validation, and a JSON form for the catalog (timedeltas as seconds)."""

    name: str
    entity_type: ClassVar[str] = ""
    immutable: ClassVar[tuple[str, ...]] = ()

    def validate(self, tier: str) -> None:
        """Normalise durations (ISO 8601 strings, "infinite" TTLs) and raise InvalidOperationError for a setting
        outside the contract's limits."""
        for name in _DURATIONS:
            if hasattr(self, name):
                value = limits.as_timedelta(getattr(self, name), name)
                if name in _NEVER_DURATIONS and isinstance(value, timedelta) and value >= limits.TTL_NEVER:
                    value = None  # Service Bus's TimeSpan.MaxValue (or more): never
                setattr(self, name, value)
        status = getattr(self, "status", None)
        if isinstance(status, str):
            try:
                setattr(self, "status", EntityStatus(status))  # noqa: B010 - every entity kind has a status; the base does not declare it
            except ValueError:
                raise InvalidOperationError(
                    f"status must be an EntityStatus ({', '.join(s.value for s in EntityStatus)}), got {status!r}"
                ) from None
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            check = _CHECKS.get(f.name)
            if check is not None:
                check(value, tier)

    @property
    def availability_status(self) -> str:
        """The SDK's EntityAvailabilityStatus of the entity: "Available" (runtime properties report each partition's)."""
        return "Available"

    def settings(self) -> dict[str, Any]:
        """The settings as JSON-ready values."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.total_seconds() if isinstance(v, timedelta) else str(v) if isinstance(v, EntityStatus) else v
        return out

    def to_json(self) -> str:
        """Serialise for the catalog."""
        return json.dumps(self.settings(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Rebuild from the catalog's JSON."""
        raw = json.loads(text)
        for f in dataclasses.fields(cls):
            if f.name in _DURATIONS and raw.get(f.name) is not None:
                try:
                    raw[f.name] = timedelta(seconds=raw[f.name])
                except OverflowError:  # written before "infinite" durations were clamped: never
                    raw[f.name] = None
                if f.name in _NEVER_DURATIONS and raw[f.name] is not None and raw[f.name] >= limits.TTL_NEVER:
                    raw[f.name] = None
        if "status" in raw:
            raw["status"] = EntityStatus(raw["status"])
        return cls(**{k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(cls)}})

    # ---- dict-like access, as the SDK's property objects (DictMixin) -----------------------------

    def keys(self) -> list[str]:
        """Setting names, and availability_status (read-only), as the SDK's property objects hold it."""
        return [*(f.name for f in dataclasses.fields(self)), "availability_status"]

    def values(self) -> list[Any]:
        """Setting values."""
        return [getattr(self, k) for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) pairs; dict(props) gives the settings as a dict."""
        return [(k, getattr(self, k)) for k in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        """A setting, or default."""
        return getattr(self, key) if key in self.keys() else default

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.keys():
            raise KeyError(key)
        if key == "availability_status":
            raise AttributeError("availability_status describes the entity: it is not a setting")
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def partition_count(self) -> int:
        """16 when partitioned, else 1."""
        return limits.PARTITION_COUNT if getattr(self, "enable_partitioning", False) else 1


@dataclass
class QueueProperties(EntityProperties):
    """A queue's settings (SDK: QueueProperties)."""

    enable_partitioning: bool = True
    max_size_in_megabytes: int = 1024
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: timedelta = timedelta(minutes=10)
    requires_session: bool = False
    lock_duration: timedelta = timedelta(seconds=60)
    max_delivery_count: int = 10
    default_message_time_to_live: timedelta | None = NEVER
    dead_lettering_on_message_expiration: bool = False
    forward_to: str | None = None
    forward_dead_lettered_messages_to: str | None = None
    auto_delete_on_idle: timedelta | None = None  # kept; idle entities are not deleted (README)
    enable_batched_operations: bool = True
    enable_express: bool = False
    user_metadata: str | None = None
    status: EntityStatus = EntityStatus.ACTIVE
    max_message_size_in_kilobytes: int | None = None
    entity_type: ClassVar[str] = "queue"
    # Fixed at creation, as in Service Bus: duplicate detection also decides where keyed messages go (message_id is a key).
    immutable: ClassVar[tuple[str, ...]] = ("enable_partitioning", "requires_session", "requires_duplicate_detection")


@dataclass
class TopicProperties(EntityProperties):
    """A topic's settings (SDK: TopicProperties)."""

    enable_partitioning: bool = True
    max_size_in_megabytes: int = 1024
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: timedelta = timedelta(minutes=10)
    default_message_time_to_live: timedelta | None = NEVER
    auto_delete_on_idle: timedelta | None = None  # kept; idle entities are not deleted (README)
    enable_batched_operations: bool = True
    enable_express: bool = False
    user_metadata: str | None = None
    status: EntityStatus = EntityStatus.ACTIVE
    support_ordering: bool = True
    max_message_size_in_kilobytes: int | None = None
    entity_type: ClassVar[str] = "topic"
    immutable: ClassVar[tuple[str, ...]] = ("enable_partitioning", "requires_duplicate_detection")


@dataclass
class SubscriptionProperties(EntityProperties):
    """A subscription's settings (SDK: SubscriptionProperties); it is stored with its topic's partitioning."""

    topic_name: str = ""
    requires_session: bool = False
    lock_duration: timedelta = timedelta(seconds=60)
    max_delivery_count: int = 10
    default_message_time_to_live: timedelta | None = NEVER
    dead_lettering_on_message_expiration: bool = False
    forward_to: str | None = None
    forward_dead_lettered_messages_to: str | None = None
    enable_partitioning: bool = True  # copied from the topic at creation
    max_size_in_megabytes: int = 1024  # copied from the topic at creation
    auto_delete_on_idle: timedelta | None = None  # kept; idle entities are not deleted (README)
    enable_batched_operations: bool = True
    enable_express: bool = False
    user_metadata: str | None = None
    status: EntityStatus = EntityStatus.ACTIVE
    dead_lettering_on_filter_evaluation_exceptions: bool = True
    entity_type: ClassVar[str] = "subscription"
    immutable: ClassVar[tuple[str, ...]] = ("enable_partitioning", "requires_session", "topic_name")


AnyEntityProperties = QueueProperties | TopicProperties | SubscriptionProperties


@dataclass
class RuleProperties:
    """A subscription rule: a filter and an optional action (SDK: RuleProperties)."""

    name: str
    filter: Any
    action: Any = None
    created_at_utc: datetime | None = None


@dataclass
class PartitionRuntimeProperties:
    """Counts of one partition."""

    partition_id: int
    available: bool = True
    active_message_count: int = 0
    dead_letter_message_count: int = 0
    scheduled_message_count: int = 0
    deferred_message_count: int = 0
    transfer_message_count: int = 0
    transfer_dead_letter_message_count: int = 0
    total_message_count: int = 0
    size_in_bytes: int = 0


COUNT_FIELDS = (
    "active_message_count",
    "dead_letter_message_count",
    "scheduled_message_count",
    "deferred_message_count",
    "transfer_message_count",
    "transfer_dead_letter_message_count",
    "total_message_count",
    "size_in_bytes",
)


@dataclass
class RuntimeProperties:
    """Runtime counts aggregated over all partitions (SDK: QueueRuntimeProperties and kin)."""

    name: str
    active_message_count: int = 0
    dead_letter_message_count: int = 0
    scheduled_message_count: int = 0
    deferred_message_count: int = 0
    transfer_message_count: int = 0
    transfer_dead_letter_message_count: int = 0
    total_message_count: int = 0
    size_in_bytes: int = 0
    availability_status: str = "Available"
    partitions: list[PartitionRuntimeProperties] = field(default_factory=list, repr=False)  # 16 of them: see .partitions
    subscription_count: int | None = None  # topics only
    created_at_utc: datetime | None = None
    updated_at_utc: datetime | None = None
    accessed_at_utc: datetime | None = None  # the last settings change: sparkqueue records no reads (README)
    status: EntityStatus = EntityStatus.ACTIVE

    @classmethod
    def aggregate(cls, name: str, parts: list[PartitionRuntimeProperties]) -> RuntimeProperties:
        """Sum per-partition counts; 'Limited' when any partition is unavailable."""
        out = cls(name=name, partitions=parts)
        for f in COUNT_FIELDS:
            setattr(out, f, sum(getattr(p, f) for p in parts))
        out.availability_status = "Available" if all(p.available for p in parts) else "Limited"
        return out


QueueRuntimeProperties = TopicRuntimeProperties = SubscriptionRuntimeProperties = RuntimeProperties

_DURATIONS = {"duplicate_detection_history_time_window", "lock_duration", "default_message_time_to_live", "auto_delete_on_idle"}
_NEVER_DURATIONS = {"default_message_time_to_live", "auto_delete_on_idle"}  # TimeSpan.MaxValue means "never"
MIN_AUTO_DELETE_ON_IDLE = timedelta(minutes=5)  # Service Bus's minimum


SETTABLE_STATUSES = (EntityStatus.ACTIVE, EntityStatus.DISABLED, EntityStatus.SEND_DISABLED, EntityStatus.RECEIVE_DISABLED)


def _check_status(value: object) -> None:
    """A status a user may set; Creating, Deleting, Renaming, Restoring and Unknown are the service's to report."""
    if not isinstance(value, EntityStatus):
        raise InvalidArgumentTypeError(f"status must be an EntityStatus, got {value!r}")
    if value not in SETTABLE_STATUSES:
        raise InvalidOperationError(
            f"status {value.value} cannot be set; use one of {', '.join(s.value for s in SETTABLE_STATUSES)}"
        )


def _check_max_message_kb(value: object, tier: str) -> None:
    """Premium only (1,024-102,400 KB); the standard tier's limit is fixed, so only None is accepted there."""
    if value is None:
        return
    if tier != limits.PREMIUM:
        raise InvalidOperationError("max_message_size_in_kilobytes can only be set in the premium tier")
    limits.check_int(value, "max_message_size_in_kilobytes", minimum=1024, maximum=102_400)


def _optional_name(value: object, field_name: str) -> None:
    if value is not None:
        limits.check_entity_name(value, field_name)


_CHECKS: dict[str, Any] = {
    "enable_partitioning": lambda v, t: limits.check_bool(v, "enable_partitioning"),
    "requires_duplicate_detection": lambda v, t: limits.check_bool(v, "requires_duplicate_detection"),
    "requires_session": lambda v, t: limits.check_bool(v, "requires_session"),
    "dead_lettering_on_message_expiration": lambda v, t: limits.check_bool(v, "dead_lettering_on_message_expiration"),
    "max_size_in_megabytes": lambda v, t: limits.check_size_mb(v, t),
    "max_delivery_count": lambda v, t: limits.check_int(v, "max_delivery_count", maximum=2**31 - 1),
    "lock_duration": lambda v, t: limits.check_duration(
        v, "lock_duration", minimum=limits.MIN_LOCK_DURATION, maximum=limits.MAX_LOCK_DURATION
    ),
    "duplicate_detection_history_time_window": lambda v, t: limits.check_duration(
        v,
        "duplicate_detection_history_time_window",
        minimum=limits.DEDUPE_WINDOW_RANGE[0],
        maximum=limits.DEDUPE_WINDOW_RANGE[1],
    ),
    "default_message_time_to_live": lambda v, t: limits.check_ttl(v, "default_message_time_to_live"),
    "auto_delete_on_idle": lambda v, t: limits.check_duration(
        v, "auto_delete_on_idle", minimum=MIN_AUTO_DELETE_ON_IDLE, allow_none=True
    ),
    "enable_batched_operations": lambda v, t: limits.check_bool(v, "enable_batched_operations"),
    "enable_express": lambda v, t: limits.check_bool(v, "enable_express"),
    "support_ordering": lambda v, t: limits.check_bool(v, "support_ordering"),
    "dead_lettering_on_filter_evaluation_exceptions": lambda v, t: limits.check_bool(
        v, "dead_lettering_on_filter_evaluation_exceptions"
    ),
    "user_metadata": lambda v, t: limits.check_text(v, "user_metadata", limits.MAX_USER_METADATA),
    "status": lambda v, t: _check_status(v),
    "max_message_size_in_kilobytes": lambda v, t: _check_max_message_kb(v, t),
    "forward_to": lambda v, t: _optional_name(v, "forward_to"),
    "forward_dead_lettered_messages_to": lambda v, t: _optional_name(v, "forward_dead_lettered_messages_to"),
}


def build_properties(cls: type[EntityProperties], name: str, tier: str, settings: dict[str, Any]) -> EntityProperties:
    """Create validated properties from keyword settings (durations as timedelta or ISO 8601); unknown keywords are an error."""
    known = {f.name for f in dataclasses.fields(cls)} - {"name"}
    unknown = set(settings) - known
    if unknown:
        raise InvalidOperationError(f"unknown {cls.entity_type} setting(s): {', '.join(sorted(unknown))}")
    try:
        props = cls(name=name, **settings)
    except TypeError as exc:
        raise InvalidArgumentTypeError(str(exc)) from None
    props.validate(tier)
    if tier == limits.PREMIUM and getattr(props, "enable_partitioning", False):
        props.enable_partitioning = False  # type: ignore[attr-defined]  # premium entities are never partitioned (docs/semantics.md §1)
    return props


def check_update(old: EntityProperties, new: EntityProperties, tier: str) -> EntityProperties:
    """The settings to store for an update; InvalidOperationError when it changes a setting fixed at creation.

    In the premium tier `enable_partitioning=True` has no effect, in an update as at creation.
    """
    if type(old) is not type(new) or old.name != new.name:
        raise InvalidOperationError(f"update must pass the {old.entity_type} properties of {old.name!r}")
    new.validate(tier)
    if tier == limits.PREMIUM and getattr(new, "enable_partitioning", False):
        new = dataclasses.replace(new, enable_partitioning=False)  # type: ignore[call-arg]
    for f in old.immutable:
        if getattr(old, f) != getattr(new, f):
            raise InvalidOperationError(f"{f} is fixed at creation and cannot be changed by an update")
    new.validate(tier)
    return new


def check_status(props: object, operation: str, name: str) -> None:
    """Refuse sends or receives the entity's status disables (EntityStatus.DISABLED, SEND_DISABLED, RECEIVE_DISABLED)."""
    status = getattr(props, "status", EntityStatus.ACTIVE)
    refused = {
        "send": (EntityStatus.DISABLED, EntityStatus.SEND_DISABLED),
        "receive": (EntityStatus.DISABLED, EntityStatus.RECEIVE_DISABLED),
    }
    if status in refused[operation]:
        raise MessagingEntityDisabledError(f"{name!r} is {status}: it does not accept {operation}s; set its status to Active")


def check_not_forwarding(props: object, name: str) -> None:
    """Refuse receiving from a queue or subscription that auto-forwards (as Service Bus does): its messages move on at once."""
    target = getattr(props, "forward_to", None)
    if target:
        raise InvalidOperationError(
            f"cannot receive from {name!r}: it forwards its messages to {target!r}; receive from there "
            "(its dead-letter sub-queue stays receivable)"
        )


def check_receivable(props: object, name: str, dead_letters: bool) -> None:
    """Refuse receives the status disables, and receives from the main sub-queue of an auto-forwarding entity."""
    check_status(props, "receive", name)
    if not dead_letters:
        check_not_forwarding(props, name)
