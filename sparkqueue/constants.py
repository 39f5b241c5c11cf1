"""Enumerations and sentinels of the public API, named as in azure-servicebus."""

from __future__ import annotations

from enum import StrEnum


class ReceiveMode(StrEnum):
    """How a receiver takes messages: lock them until settled, or remove them on receipt."""

    PEEK_LOCK = "peeklock"
    RECEIVE_AND_DELETE = "receiveanddelete"


class SubQueue(StrEnum):
    """Sub-queues a receiver can read instead of the entity itself."""

    DEAD_LETTER = "deadletter"


class _NextAvailableSession:
    """Sentinel: a session receiver takes whichever session is available next."""

    def __repr__(self) -> str:
        return "NEXT_AVAILABLE_SESSION"


NEXT_AVAILABLE_SESSION = _NextAvailableSession()


class EntityStatus(StrEnum):
    """An entity's status (SDK: EntityStatus); Disabled refuses sends and receives, SendDisabled/ReceiveDisabled one of them."""

    ACTIVE = "Active"
    CREATING = "Creating"
    DELETING = "Deleting"
    DISABLED = "Disabled"
    RECEIVE_DISABLED = "ReceiveDisabled"
    RENAMING = "Renaming"
    RESTORING = "Restoring"
    SEND_DISABLED = "SendDisabled"
    UNKNOWN = "Unknown"
