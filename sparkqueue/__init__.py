"""sparkqueue: partitioned message queues and topics for Spark, stored in Delta Lake."""

import sparkqueue.shutdown  # noqa: F401 - registers the exit hook (see shutdown.py)
from sparkqueue.auto_lock_renewer import AutoLockRenewer
from sparkqueue.constants import NEXT_AVAILABLE_SESSION, EntityStatus, ReceiveMode, SubQueue
from sparkqueue.message import Message, MessageBatch, ReceivedMessage
from sparkqueue.model.filters import CorrelationRuleFilter, FalseRuleFilter, SqlRuleAction, SqlRuleFilter, TrueRuleFilter
from sparkqueue.namespace import Namespace

__version__ = "0.1.0"

__all__ = [
    "NEXT_AVAILABLE_SESSION",
    "AutoLockRenewer",
    "CorrelationRuleFilter",
    "EntityStatus",
    "FalseRuleFilter",
    "Message",
    "MessageBatch",
    "Namespace",
    "ReceiveMode",
    "ReceivedMessage",
    "SqlRuleAction",
    "SqlRuleFilter",
    "SubQueue",
    "TrueRuleFilter",
]
