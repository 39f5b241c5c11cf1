"""sparkqueue: partitioned message queues and topics for Spark, stored in Delta Lake."""

from sparkqueue.constants import NEXT_AVAILABLE_SESSION, ReceiveMode, SubQueue
from sparkqueue.message import Message, MessageBatch, ReceivedMessage
from sparkqueue.namespace import Namespace

__version__ = "0.1.0"

__all__ = [
    "NEXT_AVAILABLE_SESSION",
    "Message",
    "MessageBatch",
    "Namespace",
    "ReceiveMode",
    "ReceivedMessage",
    "SubQueue",
]
