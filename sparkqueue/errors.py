"""Exceptions raised by sparkqueue; names follow azure-servicebus where the concept exists there."""

from __future__ import annotations


class SparkQueueError(Exception):
    """Base class of every error sparkqueue raises on purpose."""


class InvalidOperationError(SparkQueueError, ValueError):
    """The call is not valid for this entity, message or state (bad argument, wrong mode, mixed keys)."""


class InvalidArgumentTypeError(InvalidOperationError, TypeError):
    """An argument has the wrong type; a TypeError as in the SDK (and an InvalidOperationError, a ValueError)."""


class FilterSyntaxError(InvalidOperationError):
    """A SQL filter or rule action could not be parsed."""


class MessageLockLostError(SparkQueueError):
    """The lock token is not the message's current lock: it expired or a later delivery superseded it."""


class MessageAlreadySettled(MessageLockLostError, ValueError):  # noqa: N818 (the SDK's name)
    """The message was already settled through this handle (SDK: MessageAlreadySettled); its lock is gone."""


class SessionLockLostError(SparkQueueError):
    """The receiver's session lock expired or was released; accept the session again."""


class MessageSizeExceededError(SparkQueueError, ValueError):
    """A message (body and properties) is larger than the tier allows, or does not fit a batch."""


class QuotaExceededError(SparkQueueError):
    """A size or count limit of the entity or namespace would be exceeded; nothing was stored."""


class PartitionUnavailableError(SparkQueueError):
    """A partition the operation needs cannot be reached; nothing was changed."""


class EntityNotFoundError(SparkQueueError):
    """The queue, topic, subscription or rule does not exist in the namespace."""


class EntityAlreadyExistsError(SparkQueueError):
    """An entity of that name already exists in the namespace."""


class SessionCannotBeLockedError(SparkQueueError):
    """The session is locked by another receiver, or no session is available."""


class MessageNotFoundError(SparkQueueError):
    """The requested message (e.g. a deferred message by sequence number) does not exist in that state."""


class MessagingEntityDisabledError(SparkQueueError):
    """The entity's status refuses the operation (Disabled, SendDisabled or ReceiveDisabled)."""


class AutoLockRenewFailed(SparkQueueError):  # noqa: N818 (the SDK's name)
    """An AutoLockRenewer could not renew a lock; the cause is in `error`."""

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.error = error


class AutoLockRenewTimeout(SparkQueueError):  # noqa: N818 (the SDK's name)
    """An AutoLockRenewer stopped renewing because max_lock_renewal_duration elapsed."""


class OperationTimeoutError(SparkQueueError, TimeoutError):
    """The operation did not finish within the client's operation_timeout."""


class StorageError(SparkQueueError):
    """The namespace's store cannot be used: unreachable, wrong credentials, missing container, or a table it cannot write."""


class StorageCorruptedError(StorageError):
    """Stored data is damaged (an empty or truncated log entry, a missing data file, a lost catalog): never read as empty."""


__all__ = [
    "AutoLockRenewFailed",
    "AutoLockRenewTimeout",
    "InvalidArgumentTypeError",
    "MessageNotFoundError",
    "MessagingEntityDisabledError",
    "EntityAlreadyExistsError",
    "EntityNotFoundError",
    "FilterSyntaxError",
    "InvalidOperationError",
    "MessageAlreadySettled",
    "MessageLockLostError",
    "MessageSizeExceededError",
    "OperationTimeoutError",
    "PartitionUnavailableError",
    "QuotaExceededError",
    "SessionCannotBeLockedError",
    "SessionLockLostError",
    "SparkQueueError",
    "StorageCorruptedError",
    "StorageError",
]
