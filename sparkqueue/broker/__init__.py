"""The broker core (README "Architecture"): the catalog, entity handles, the one send and settle paths, transactions.

`core.Broker` is what the public API, the management client and Spark all stand on; the open
transaction (`transaction.Transaction`) travels in a ContextVar that `Broker.send` and
`Broker.settle` consult.
"""

from sparkqueue.broker.core import (
    PROPERTY_TYPES,
    Broker,
    rule_from_entry,
    split_subscription_path,
    sub_entity_name,
)
from sparkqueue.broker.transaction import Transaction, open_transaction, refuse_in_transaction

__all__ = [
    "PROPERTY_TYPES",
    "Broker",
    "Transaction",
    "open_transaction",
    "refuse_in_transaction",
    "rule_from_entry",
    "split_subscription_path",
    "sub_entity_name",
]
