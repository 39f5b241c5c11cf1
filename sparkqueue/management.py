"""Administration of queues, topics, subscriptions and rules (SDK: ServiceBusAdministrationClient).

The client holds a broker core (composition) and calls only its public methods; `Namespace`
extends it. Every method here changes or reads the catalog, and management of an entity with
an unavailable partition fails without changing anything (docs/semantics.md §1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sparkqueue.broker import (
    PROPERTY_TYPES,
    Broker,
    refuse_in_transaction,
    rule_from_entry,
    split_subscription_path,
    sub_entity_name,
)
from sparkqueue.constants import EntityStatus
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    FilterSyntaxError,
    InvalidArgumentTypeError,
    InvalidOperationError,
    PartitionUnavailableError,
    QuotaExceededError,
    SparkQueueError,
    StorageCorruptedError,
    StorageError,
)
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, RULE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.model.deadlines import call_timeout
from sparkqueue.model.filters import (
    CorrelationRuleFilter,
    RuleFilter,
    SqlRuleAction,
    SqlRuleFilter,
    TrueRuleFilter,
    action_from_dict,
    filter_from_dict,
)
from sparkqueue.model.properties import (
    EntityProperties,
    PartitionRuntimeProperties,
    QueueProperties,
    RuleProperties,
    RuntimeProperties,
    SubscriptionProperties,
    TopicProperties,
    build_properties,
    check_update,
)
from sparkqueue.model.topics import ACCEPTED_MARKER, check_session_action
from sparkqueue.storage import maintenance
from sparkqueue.storage.catalog import CatalogEntry
from sparkqueue.storage.check import Finding, check_table
from sparkqueue.storage.log import delete_table
from sparkqueue.storage.table import EntityTable

if TYPE_CHECKING:
    from sparkqueue.model.entity import Entity

log = logging.getLogger(__name__)

DEFAULT_RULE = "$Default"
ENTITIES_DIR = "entities"  # entity tables live in entities/<type>-<uuid> under the root


def rule_entity_name(topic_name: str, subscription_name: str, rule: str) -> str:
    """Catalog name of a rule."""
    limits.check_name_type(rule, "rule")
    sub_entity_name(topic_name, subscription_name)  # checks both names
    return Address.rule_of(topic_name, subscription_name, rule).name


# Fields of the SDK's property objects that describe the entity rather than set it: an update's dict may hold them.
READ_ONLY_FIELDS = frozenset({"availability_status"})


def _as_properties(cls: type[EntityProperties], value: object, overrides: dict[str, Any]) -> EntityProperties:
    """An update's properties: a property object or a dict of its fields (as the SDK), with keyword overrides; a copy."""
    if isinstance(value, cls):
        props = dataclasses.replace(value)
    elif isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        value = {k: v for k, v in value.items() if k not in READ_ONLY_FIELDS}  # as the SDK's dict form holds them
        unknown = set(value) - known
        if unknown or "name" not in value:
            raise InvalidOperationError(
                f"a {cls.__name__} dict needs 'name' and only its fields; unknown: {', '.join(sorted(map(str, unknown)))}"
            )
        missing = known - set(value)
        if missing:  # as the SDK: a dict stands for a whole properties object; a missing field would reset it silently
            raise InvalidArgumentTypeError(
                f"a {cls.__name__} dict needs all its fields (missing: {', '.join(sorted(missing))}); to change some, "
                f"pass the current properties with keywords: update_{cls.entity_type}(get_{cls.entity_type}(...), field=value)"
            )
        props = cls(**dict(value))
    else:
        raise InvalidArgumentTypeError(f"expected {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    limits.check_name_type(props.name, cls.entity_type)
    for k, v in overrides.items():
        if k == "name" or k not in {f.name for f in dataclasses.fields(cls)}:
            raise InvalidOperationError(f"unknown {cls.entity_type} setting {k!r}")
        setattr(props, k, v)
    return props


class Management:
    """Create, read, update, delete and list entities: the administration client, built on a broker core.

    It holds a `Broker` (composition) and calls only its public methods; `Namespace` extends it
    with the messaging client over the same broker, and `Management(Broker(root))` administers a
    namespace on its own.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    # ---- generic ---------------------------------------------------------------------------------

    def _create_entry(
        self,
        entity_type: str,
        name: str,
        props: EntityProperties,
        table_path: str,
        extra: tuple[CatalogEntry, ...] = (),
        require: Callable[[list[CatalogEntry]], None] | None = None,
    ) -> None:
        """Insert the catalog entry (and extras, e.g. a default rule) in one commit; EntityAlreadyExistsError if taken.

        `require` checks the catalog as the commit finds it (Catalog.insert) and raises to refuse.
        """
        now = datetime.now(UTC)
        entry = CatalogEntry(Address.of(entity_type, name).key, entity_type, table_path, props.to_json(), now, now)
        same = _same_entity_name(entity_type, name) if entity_type in (QUEUE, TOPIC, SUBSCRIPTION) else None
        if not self.broker.catalog.insert([entry, *extra], self.broker.deadline(), same, require):
            taken = next((Address.parse(e.name) for e in self.broker.catalog.entries() if same and same(e.name)), None)
            if taken is not None and taken != Address.of(entity_type, name):
                space = (
                    "a topic's subscription names"
                    if entity_type == SUBSCRIPTION
                    else "queue and topic names share one name space"
                )
                raise EntityAlreadyExistsError(
                    f"{entity_type} {Address.of(entity_type, name).path!r} cannot be created: {taken.kind} {taken.path!r} "
                    f"exists in namespace {self.broker.root!r}, and in {space} case does not count"
                )
            shown = Address.of(entity_type, name).path
            raise EntityAlreadyExistsError(f"{entity_type} {shown!r} already exists in namespace {self.broker.root!r}")
        log.info("created %s %s", entity_type, name)

    def _create_with_table(self, entity_type: str, name: str, settings: dict[str, Any]) -> EntityProperties:
        """Create a queue or topic: its own Delta table, then its catalog entry."""
        props = build_properties(PROPERTY_TYPES[entity_type], name, self.broker.tier, settings)
        self._check_entity_quota(props)  # before the table is made; checked again in the catalog commit
        table_path = f"{ENTITIES_DIR}/{entity_type}-{uuid.uuid4().hex}"  # relative: the namespace can move
        try:
            EntityTable.create(self.broker.table_uri(table_path), self.broker.store_options)
            self._create_entry(
                entity_type, name, props, table_path, require=lambda entries: self._check_entity_quota(props, entries)
            )
        except BaseException as exc:
            recorded = self._recorded(table_path)
            if recorded is False:
                try:
                    self._remove_table(table_path, keep_tombstone=False)  # unrecorded: no handle holds it
                except Exception as cleanup:  # the store may be what failed: the create's own error is the one to report
                    log.warning("could not remove the table of the failed create (maintenance removes it later): %s", cleanup)
            if not recorded or not isinstance(exc, Exception):
                raise
            log.warning("creating %s %s reported %s, but the catalog records it: created", entity_type, name, exc)
        self._check_table_kept(entity_type, name, table_path)  # after the try: the entry is recorded, the table stays
        return props

    def _recorded(self, table_path: str) -> bool | None:
        """Whether the catalog names the table a failed create made; None when it cannot be read.

        A catalog commit that failed may have landed all the same (a lost reply): its table must then
        stay, or the entity would name no table for good. Left unnamed, maintenance removes it later.
        """
        try:
            return any(e.table_path == table_path for e in self.broker.catalog.entries())
        except Exception as exc:
            log.warning("could not tell whether the failed create of %s was recorded; its table stays: %s", table_path, exc)
            return None

    def _check_table_kept(self, entity_type: str, name: str, table_path: str) -> None:
        """StorageError, the entry deleted again, when maintenance removed the new table before the catalog named it.

        Maintenance removes a table no entry names once its files are older than the orphan
        retention (docs/storage.md): a create held up that long between making its table and
        recording it would leave an entry naming no table, which refuses every send for good.
        """
        try:
            if EntityTable(self.broker.table_uri(table_path), 1, storage_options=self.broker.store_options).log.exists():
                return
        except (SparkQueueError, OSError) as exc:  # no answer is not "gone": the table was made, keep the create
            log.warning("could not check that the table of %s %s is still there: %s", entity_type, name, exc)
            return
        key = Address.of(entity_type, name).key
        self.broker.catalog.delete([key], self.broker.deadline(), _children_of(entity_type, name), table_path)
        self.broker.forget(key)
        raise StorageError(
            f"{entity_type} {name!r} was not created: maintenance removed its new table while the create was held up "
            "(longer than the orphan retention) before recording it; create it again"
        )

    def _remove_table(self, table_path: str, *, keep_tombstone: bool = True) -> None:
        """Delete an entity table's files, data first and log last (a half-deleted table reads as deleted); its tombstone
        stays for handles that predate the delete until maintenance removes it (storage.log.delete_table)."""
        if "://" in table_path or table_path.startswith("/"):
            log.warning("leaving %s in place: it was recorded outside the namespace root", table_path)
            return
        delete_table(self.broker.store.child(table_path), keep_tombstone=keep_tombstone)

    def _check_entity_quota(self, props: EntityProperties, catalog: list[CatalogEntry] | None = None) -> None:
        """At most 10,000 entities and 100 partitioned queues and topics per namespace (in `catalog`; default: now)."""
        catalog = self.broker.catalog.entries() if catalog is None else catalog
        entries = [e for e in catalog if e.entity_type != RULE]
        if len(entries) >= limits.MAX_ENTITIES:
            raise QuotaExceededError(f"the namespace already holds {limits.MAX_ENTITIES} entities; delete one first")
        if props.partition_count > 1 and props.entity_type in (QUEUE, TOPIC):
            partitioned = sum(
                1 for e in entries if e.entity_type in (QUEUE, TOPIC) and '"enable_partitioning": true' in e.properties
            )
            if partitioned >= limits.MAX_PARTITIONED_ENTITIES:
                raise QuotaExceededError(
                    f"the namespace already holds {limits.MAX_PARTITIONED_ENTITIES} partitioned queues and topics; "
                    "create this one with enable_partitioning=False or delete one"
                )

    def _require_all_partitions(self, entity: Entity, what: str) -> None:
        """Management acts on every partition: refuse when any is unavailable."""
        down = [p for p in range(entity.partition_count) if not entity.available(p)]
        if down:
            raise PartitionUnavailableError(
                f"cannot {what}: partition(s) {down} of {entity.name!r} are unavailable; nothing was changed"
            )

    def _require_topic_partitions(self, topic_name: str, what: str) -> None:
        """Subscriptions and rules live in their topic's table and fan-out: all its partitions must be available."""
        self._require_all_partitions(self.broker.entity(TOPIC, topic_name), what)

    def _get(self, entity_type: str, name: str) -> EntityProperties:
        return PROPERTY_TYPES[entity_type].from_json(self.broker.entry(entity_type, name).properties)

    def _update(self, entity_type: str, name: str, props: EntityProperties) -> None:
        """Replace an entity's settings, refusing changes to settings fixed at creation."""
        cls = PROPERTY_TYPES[entity_type]
        if not isinstance(props, cls):
            raise InvalidArgumentTypeError(f"update_{entity_type} needs {cls.__name__}, got {type(props).__name__}")
        name = self.broker.canonical(entity_type, name)  # a name in another case updates the entity as stored
        props = dataclasses.replace(props, name=Address.of(entity_type, name).leaf)
        entity = self.broker.entity(entity_type, name)
        entry = self.broker.entry(entity_type, name)
        old = PROPERTY_TYPES[entity_type].from_json(entry.properties)
        props = check_update(old, props, self.broker.tier)
        self._require_all_partitions(entity, f"update {entity_type} {name!r}")
        # Checked against this entry's settings: the change applies only while the key still names its table, so
        # an entity deleted and made again meanwhile (other fixed settings) is not rewritten with these.
        key = Address.of(entity_type, name).key
        rerouted = getattr(old, "forward_to", None) != getattr(props, "forward_to", None)
        if rerouted:  # the main route rests from before the change until every process knows it (docs/semantics.md §9)
            self.broker.entity(entity_type, name).mark_route_change()
        if not self.broker.catalog.update(key, props.to_json(), self.broker.deadline(), entry.table_path):
            raise EntityNotFoundError(f"{entity_type} {name!r} does not exist (it was deleted meanwhile)")
        self.broker.forget(key)
        if rerouted:
            self.broker.entity(entity_type, name).mark_route_change()
        left, new_route = _left_destination(old, props), _new_route(old, props)
        if left or new_route:
            self.broker.forward_after_route_change(entity_type, name, left, new_route)

    def _delete_entries(self, entity_type: str, name: str) -> CatalogEntry:
        """Delete an entity's catalog entry and its children's (subscriptions, rules) in one commit."""
        entity = self.broker.entity(entity_type, name)
        self._require_all_partitions(entity, f"delete {entity_type} {name!r}")
        entry = self.broker.entry(entity_type, name)
        children = _children_of(entity_type, name)
        keys = [entry.name]
        if children is not None:
            keys += [e.name for e in self.broker.catalog.entries() if children(e.name)]  # to forget their cached settings
        if self.broker.catalog.delete(keys[:1], self.broker.deadline(), children, entry.table_path) == 0:
            raise EntityNotFoundError(f"{entity_type} {name!r} does not exist (it was deleted meanwhile)")
        for k in keys:
            self.broker.forget(k)
        log.info("deleted %s %s", entity_type, name)
        return entry

    def _runtime(self, entity_type: str, name: str) -> RuntimeProperties:
        entry = self.broker.entry(entity_type, name)
        entity = self.broker.entity(entity_type, name)
        rp = entity.runtime_properties(self._subscription_keys(name) if entity_type == TOPIC else None)
        rp.name, rp.created_at_utc, rp.updated_at_utc = name, entry.created_at_utc, entry.updated_at_utc
        rp.accessed_at_utc = entry.updated_at_utc
        rp.status = getattr(entity.props, "status", EntityStatus.ACTIVE)
        return rp

    # ---- queues ----------------------------------------------------------------------------------

    def create_queue(self, queue_name: str, **settings: Any) -> QueueProperties:
        """Create a queue; settings are the SDK's keyword names (enable_partitioning, lock_duration, ...)."""
        self._check_destinations(settings, limits.check_entity_name(queue_name))
        return self._create_with_table(QUEUE, queue_name, settings)  # type: ignore[return-value]

    def get_queue(self, queue_name: str) -> QueueProperties:
        """The queue's settings."""
        return self._get(QUEUE, limits.check_name_type(queue_name))  # type: ignore[return-value]

    def update_queue(self, queue: QueueProperties | Mapping[str, Any], **settings: Any) -> None:
        """Apply changed settings (partitioning and sessions are fixed at creation); keywords override the given ones."""
        props = _as_properties(QueueProperties, queue, settings)
        self._check_destinations(props.settings(), props.name, self._get(QUEUE, props.name))
        self._update(QUEUE, props.name, props)

    def delete_queue(self, queue_name: str) -> None:
        """Delete the queue and all its messages."""
        limits.check_name_type(queue_name)
        self._remove_table(self._delete_entries(QUEUE, queue_name).table_path)

    def list_queues(self) -> list[QueueProperties]:
        """All queues, by name."""
        return [QueueProperties.from_json(e.properties) for e in self.broker.catalog.entries(QUEUE)]

    def get_queue_runtime_properties(self, queue_name: str) -> RuntimeProperties:
        """Message counts and size, aggregated over partitions, with the per-partition breakdown."""
        return self._runtime(QUEUE, limits.check_name_type(queue_name))

    def list_queues_runtime_properties(self) -> list[RuntimeProperties]:
        """Runtime properties of every queue, by name."""
        return [_listed(functools.partial(self._runtime, QUEUE, q.name), q) for q in self.list_queues()]

    # ---- topics ----------------------------------------------------------------------------------

    def create_topic(self, topic_name: str, **settings: Any) -> TopicProperties:
        """Create a topic (partitioned like a queue); its subscriptions are stored in its table."""
        return self._create_with_table(TOPIC, limits.check_entity_name(topic_name, "topic"), settings)  # type: ignore[return-value]

    def get_topic(self, topic_name: str) -> TopicProperties:
        """The topic's settings."""
        return self._get(TOPIC, limits.check_name_type(topic_name, "topic"))  # type: ignore[return-value]

    def update_topic(self, topic: TopicProperties | Mapping[str, Any], **settings: Any) -> None:
        """Apply changed topic settings (partitioning is fixed at creation); keywords override the given ones."""
        props = _as_properties(TopicProperties, topic, settings)
        self._update(TOPIC, props.name, props)

    def delete_topic(self, topic_name: str) -> None:
        """Delete the topic with its subscriptions, rules and messages."""
        limits.check_name_type(topic_name, "topic")
        self._remove_table(self._delete_entries(TOPIC, topic_name).table_path)

    def list_topics(self) -> list[TopicProperties]:
        """All topics, by name."""
        return [TopicProperties.from_json(e.properties) for e in self.broker.catalog.entries(TOPIC)]

    def get_topic_runtime_properties(self, topic_name: str) -> RuntimeProperties:
        """Counts over all the topic's subscriptions, and its subscription count."""
        rp = self._runtime(TOPIC, limits.check_name_type(topic_name, "topic"))
        rp.subscription_count = len(self.list_subscriptions(topic_name))
        return rp

    def list_topics_runtime_properties(self) -> list[RuntimeProperties]:
        """Runtime properties of every topic, by name."""
        return [_listed(functools.partial(self.get_topic_runtime_properties, t.name), t) for t in self.list_topics()]

    # ---- subscriptions ---------------------------------------------------------------------------

    def create_subscription(self, topic_name: str, subscription_name: str, **settings: Any) -> SubscriptionProperties:
        """Create a subscription with the rule $Default (a true filter); it gets the topic's partitioning."""
        limits.check_child_name(subscription_name, "subscription")
        if subscription_name.startswith("$"):
            raise InvalidOperationError(f"subscription names cannot start with '$': {subscription_name!r}")
        topic = self.get_topic(topic_name)
        self._check_topic_settings(topic, settings)
        self._check_destinations(settings, topic_name=topic.name)
        topic_entry = self.broker.entry(TOPIC, topic_name)
        self._require_topic_partitions(topic_name, f"create subscription {topic_name}/{subscription_name}")
        settings = {
            **settings,
            "topic_name": topic_name,
            "enable_partitioning": topic.enable_partitioning,
            "max_size_in_megabytes": topic.max_size_in_megabytes,
        }
        props = build_properties(SubscriptionProperties, subscription_name, self.broker.tier, settings)
        self._check_entity_quota(props)
        key = f"{subscription_name}.{uuid.uuid4().hex[:12]}"
        name = sub_entity_name(topic_name, subscription_name)
        now = datetime.now(UTC)
        default = CatalogEntry(
            Address.of(RULE, rule_entity_name(topic_name, subscription_name, DEFAULT_RULE)).key,
            RULE,
            "",
            _rule_json(TrueRuleFilter(), None),
            now,
            now,
        )
        topic_key = topic_entry.name

        def require(catalog: list[CatalogEntry]) -> None:  # the topic may be deleted (or re-created) meanwhile
            if not any(e.name == topic_key and e.table_path == topic_entry.table_path for e in catalog):
                raise EntityNotFoundError(f"topic {topic_name!r} was deleted while its subscription was being created")
            self._check_entity_quota(props, catalog)
            _check_topic_quota(Address.parse(topic_key).topic, catalog, SUBSCRIPTION)
            _check_topic_quota(Address.parse(topic_key).topic, catalog, "SqlRuleFilter")  # its $Default rule

        self._create_entry(SUBSCRIPTION, name, props, f"{topic_entry.table_path}#{key}", (default,), require)
        self.broker.forget(Address.of(TOPIC, topic_name).key)
        return props  # type: ignore[return-value]

    def get_subscription(self, topic_name: str, subscription_name: str) -> SubscriptionProperties:
        """The subscription's settings."""
        props: SubscriptionProperties = self._get(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))  # type: ignore[assignment]
        return _sized_as(props, self.get_topic(topic_name))

    def _check_topic_size(self, topic_name: str, props: EntityProperties) -> None:
        """A subscription's size must be its topic's: its copies live in the topic's table, under the topic's quota."""
        topic = self.get_topic(topic_name)
        _refuse_other_than_topic("max_size_in_megabytes", getattr(props, "max_size_in_megabytes", None), topic)

    def _check_topic_settings(self, topic: TopicProperties, settings: dict[str, Any]) -> None:
        """A new subscription's partitioning and size are its topic's: other values are refused, as by an update.

        None stands for "not given" (the SDK's keyword default). In the premium tier enable_partitioning=True has no
        effect, as at an update (model.properties.check_update).
        """
        partitioning = settings.get("enable_partitioning")
        if partitioning is not None:
            partitioning = limits.check_bool(partitioning, "enable_partitioning") and self.broker.tier != limits.PREMIUM
            _refuse_other_than_topic("enable_partitioning", partitioning, topic)
        if settings.get("max_size_in_megabytes") is not None:
            _refuse_other_than_topic("max_size_in_megabytes", settings["max_size_in_megabytes"], topic)

    def update_subscription(
        self, topic_name: str, subscription: SubscriptionProperties | Mapping[str, Any], **settings: Any
    ) -> None:
        """Apply changed subscription settings (sessions are fixed at creation); keywords override the given ones."""
        props = _as_properties(SubscriptionProperties, subscription, settings)
        self._check_topic_size(topic_name, props)
        current = self._get(SUBSCRIPTION, sub_entity_name(topic_name, props.name))
        self._check_destinations(props.settings(), current=current, topic_name=topic_name)
        self._update(SUBSCRIPTION, sub_entity_name(topic_name, props.name), props)
        self.broker.forget(Address.of(TOPIC, topic_name).key)  # fan-out caches the subscriptions' TTL and forwarding

    def delete_subscription(self, topic_name: str, subscription_name: str) -> None:
        """Delete the subscription and its rules; its messages disappear with it (maintenance reclaims the space)."""
        name = sub_entity_name(topic_name, subscription_name)
        self._delete_entries(SUBSCRIPTION, name)
        self.broker.forget(Address.of(TOPIC, topic_name).key)

    def list_subscriptions(self, topic_name: str) -> list[SubscriptionProperties]:
        """The topic's subscriptions, by name."""
        topic = self.get_topic(limits.check_name_type(topic_name, "topic"))
        return [
            _sized_as(SubscriptionProperties.from_json(e.properties), topic)
            for e in self.broker.catalog.entries(SUBSCRIPTION)
            if Address.parse(e.name).topic == topic_name
        ]

    def get_subscription_runtime_properties(self, topic_name: str, subscription_name: str) -> RuntimeProperties:
        """Message counts of the subscription, aggregated over partitions."""
        rp = self._runtime(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))
        rp.name = subscription_name
        return rp

    def list_subscriptions_runtime_properties(self, topic_name: str) -> list[RuntimeProperties]:
        """Runtime properties of every subscription of the topic, by name."""
        return [
            _listed(functools.partial(self.get_subscription_runtime_properties, topic_name, s.name), s)
            for s in self.list_subscriptions(topic_name)
        ]

    # ---- rules -----------------------------------------------------------------------------------

    def create_rule(
        self, topic_name: str, subscription_name: str, rule_name: str, *, filter: Any = None, action: Any = None
    ) -> RuleProperties:
        """Add a rule (a filter, default true, and an optional SqlRuleAction) to a subscription."""
        self._no_rule_changes_in_transaction()
        limits.check_child_name(rule_name, "rule")
        sub_entry = self.broker.entry(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))
        flt, action = _stored_rule(filter if filter is not None else TrueRuleFilter(), action)
        self._check_action_fits(topic_name, subscription_name, action)
        self._require_topic_partitions(topic_name, f"create rule {rule_name!r} on {topic_name}/{subscription_name}")
        now = datetime.now(UTC)
        key = Address.of(RULE, rule_entity_name(topic_name, subscription_name, rule_name)).key
        entry = CatalogEntry(key, RULE, "", _rule_json(flt, action), now, now)

        def require(catalog: list[CatalogEntry]) -> None:  # the subscription may be deleted (or re-created) meanwhile
            if not any(e.name == sub_entry.name and e.table_path == sub_entry.table_path for e in catalog):
                raise EntityNotFoundError(
                    f"subscription {topic_name}/{subscription_name} was deleted while its rule was being created"
                )
            _check_topic_quota(Address.parse(sub_entry.name).topic, catalog, _filter_kind(flt.to_dict()))

        same = _same_entity_name(RULE, rule_entity_name(topic_name, subscription_name, rule_name))
        if not self.broker.catalog.insert([entry], self.broker.deadline(), same, require):
            taken = next((Address.parse(e.name).leaf for e in self.broker.catalog.entries(RULE) if same(e.name)), rule_name)
            alike = "" if taken == rule_name else f" as {taken!r} (rule names ignore case)"
            raise EntityAlreadyExistsError(f"rule {rule_name!r} already exists on {topic_name}/{subscription_name}{alike}")
        self.broker.forget(Address.of(TOPIC, topic_name).key)
        return RuleProperties(rule_name, flt, action)

    def get_rule(self, topic_name: str, subscription_name: str, rule_name: str) -> RuleProperties:
        """A rule of a subscription."""
        entry = self.broker.entry(RULE, rule_entity_name(topic_name, subscription_name, rule_name))
        return rule_from_entry(entry)

    def update_rule(
        self, topic_name: str, subscription_name: str, rule: RuleProperties | Mapping[str, Any], **settings: Any
    ) -> None:
        """Replace a rule's filter and action (SDK: update_rule); keywords `filter`/`action` override the given ones."""
        self._no_rule_changes_in_transaction()
        if isinstance(rule, Mapping):
            rule = RuleProperties(rule.get("name"), rule.get("filter"), rule.get("action"))  # type: ignore[arg-type]
        if not isinstance(rule, RuleProperties):
            raise InvalidArgumentTypeError(f"expected RuleProperties or a dict of its fields, got {type(rule).__name__}")
        unknown = set(settings) - {"filter", "action"}
        if unknown:
            raise InvalidOperationError(f"unknown rule setting(s): {', '.join(sorted(unknown))}")
        flt = settings.get("filter", rule.filter)
        action = settings.get("action", rule.action)
        flt, action = _stored_rule(flt if flt is not None else TrueRuleFilter(), action)
        name = self.broker.canonical(RULE, rule_entity_name(topic_name, subscription_name, rule.name))
        key = Address.of(RULE, name).key
        self.broker.entry(RULE, name)
        self._check_action_fits(topic_name, subscription_name, action)
        self._require_topic_partitions(topic_name, f"update rule {rule.name!r} of {topic_name}/{subscription_name}")
        if not self.broker.catalog.update(key, _rule_json(flt, action), self.broker.deadline()):
            raise EntityNotFoundError(f"rule {rule.name!r} does not exist on {topic_name}/{subscription_name}")
        self.broker.forget(Address.of(TOPIC, topic_name).key)

    def delete_rule(self, topic_name: str, subscription_name: str, rule_name: str) -> None:
        """Remove a rule from a subscription."""
        self._no_rule_changes_in_transaction()
        key = Address.of(RULE, rule_entity_name(topic_name, subscription_name, rule_name)).key
        self._require_topic_partitions(topic_name, f"delete rule {rule_name!r} of {topic_name}/{subscription_name}")
        if self.broker.catalog.delete([key], self.broker.deadline()) == 0:
            raise EntityNotFoundError(f"rule {rule_name!r} does not exist on {topic_name}/{subscription_name}")
        self.broker.forget(Address.of(TOPIC, topic_name).key)

    def list_rules(self, topic_name: str, subscription_name: str) -> list[RuleProperties]:
        """The rules of a subscription, by name."""
        self.broker.entry(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))
        sub = Address.subscription_of(topic_name, subscription_name)
        return [rule_from_entry(e) for e in self.broker.catalog.entries(RULE) if Address.parse(e.name).is_child_of(sub)]

    # ---- maintenance -----------------------------------------------------------------------------

    def run_maintenance(
        self, *, vacuum_retention: timedelta = maintenance.DEFAULT_VACUUM_RETENTION, vacuum: bool = True
    ) -> dict[str, maintenance.MaintenanceReport]:
        """Compact, clean, checkpoint and vacuum every queue and topic table; finish pending forwards first.

        Safe beside live senders and receivers: compaction only replaces files nobody changed
        meanwhile. Tombstones are kept for the entity's duplicate-detection window. A partition that
        is unavailable (a fault, a damaged data file) is left alone and listed in its report's
        `unavailable_partitions`; the rest of its table is compacted, checkpointed and vacuumed.
        """
        if not isinstance(vacuum_retention, timedelta):  # checked before any table is touched
            kind = type(vacuum_retention).__name__
            raise InvalidArgumentTypeError(f"vacuum_retention must be a datetime.timedelta, got {kind}")
        if vacuum_retention < timedelta(0):
            raise InvalidOperationError(f"vacuum_retention must not be negative, got {limits.show_duration(vacuum_retention)}")
        vacuum = limits.check_bool(vacuum, "vacuum")
        self.broker.forward_pending_messages()
        reports: dict[str, maintenance.MaintenanceReport] = {}
        entries = self.broker.catalog.entries()
        for e in entries:
            if e.entity_type not in (QUEUE, TOPIC):
                continue
            name = Address.parse(e.name).name
            try:
                report = self._maintain(e.entity_type, name, vacuum_retention if vacuum else None)
            except SparkQueueError as exc:  # one faulty entity never blocks the others
                log.error("maintenance of %s %s skipped: %s", e.entity_type, name, exc)
                reports[f"{e.entity_type}:{name}"] = maintenance.MaintenanceReport(error=str(exc))
                continue
            reports[f"{e.entity_type}:{name}"] = report
            log.info(
                "maintenance of %s %s: %d -> %d files, %d rows dropped",
                e.entity_type,
                name,
                report.files_before,
                report.files_after,
                report.rows_dropped,
            )
            if report.unavailable_partitions:  # compacted around them; checkpointed and vacuumed all the same
                down = ", ".join(map(str, sorted(report.unavailable_partitions)))
                log.warning("maintenance of %s %s left unavailable partition(s) %s alone", e.entity_type, name, down)
        reports["catalog"] = maintenance.maintain_catalog(self.broker.catalog, vacuum_retention if vacuum else None)
        if vacuum:
            reports["orphan tables"] = maintenance.remove_orphan_tables(
                self.broker.store, ENTITIES_DIR, self._table_paths, vacuum_retention
            )
        return reports

    def _table_paths(self) -> set[str]:
        """The entity tables the catalog names now (a subscription's is its topic's)."""
        root = self.broker.root.rstrip("/") + "/"
        paths = {e.table_path.partition("#")[0] for e in self.broker.catalog.entries() if e.table_path}  # "<topic table>#<key>"
        out = set()
        for p in paths:  # entries of older namespaces record absolute paths, maybe under another spelling of the root
            rel = p.removeprefix(root)
            _, sep, name = rel.rpartition(f"/{ENTITIES_DIR}/")
            out.add(f"{ENTITIES_DIR}/{name}" if sep else rel)  # a table's folder name is its own (a fresh uuid)
        return out

    def _maintain(self, entity_type: str, name: str, vacuum_retention: timedelta | None) -> maintenance.MaintenanceReport:
        """Compact, checkpoint and (when a retention is given) vacuum one queue's or topic's table."""
        entity = self.broker.entity(entity_type, name)
        window = getattr(entity.props, "duplicate_detection_history_time_window", None) or timedelta(0)
        live = None
        if entity_type == TOPIC:  # read now, not when the run started: a subscription created since is no orphan
            # The topic's own id records (ACCEPTED_MARKER) are kept for its duplicate-detection window.
            live = maintenance.LiveSubscriptions.read(lambda: self._subscription_keys(name) | {ACCEPTED_MARKER})
        report = maintenance.compact(entity.table, drop_before=datetime.now(UTC) - window, live_subscriptions=live)
        maintenance.checkpoint(entity.table, report)
        if vacuum_retention is not None:
            maintenance.vacuum(entity.table, vacuum_retention, report)
        return report

    def _subscription_keys(self, topic: str) -> set[str]:
        """The keys that mark the rows of the topic's live subscriptions in its table."""
        return {
            split_subscription_path(s.table_path)[1]
            for s in self.broker.catalog.entries()
            if s.entity_type == SUBSCRIPTION and Address.parse(s.name).topic == topic
        }

    def check(self, *, repair: bool = False) -> list[Finding]:
        """Damage in the namespace's entity tables, by table; with `repair`, what is safe to repair is repaired.

        An empty list means nothing was found. See docs/storage.md for what is checked and repaired.
        """
        limits.check_bool(repair, "repair")  # a repair drops what it cannot read: never on a mistyped flag
        findings: list[Finding] = []
        for e in self.broker.catalog.entries():
            if e.entity_type not in (QUEUE, TOPIC):
                continue
            name = Address.parse(e.name).name
            b = self.broker
            table = EntityTable(b.table_uri(e.table_path), 1, b.fault_injector(name, e.entity_type), b.store_options)
            try:
                found = check_table(table, repair=repair)
            except SparkQueueError as exc:
                found = [Finding(table.uri, str(exc))]
            except FileNotFoundError:
                found = [Finding(table.uri, "the table's log is missing, though the catalog names the table")]
            if found and not self._still_named(e):
                continue  # deleted since the catalog was read: what check found was that delete at work
            for f in found:
                f.table = f"{e.entity_type} {name} ({f.table})"
            findings += found
        for path, count in maintenance.unnamed_tables(self.broker.store, ENTITIES_DIR, self._table_paths).items():
            findings.append(  # never repaired: its entry, not the table, may be what is damaged
                Finding(
                    f"table {path}",
                    f"no catalog entry names this table, which holds {count} data file(s): the namespace catalog lost "
                    "its entry, or a delete was interrupted; maintenance leaves it alone",
                )
            )
        if repair:
            with self.broker.lock:
                self.broker.tables.clear()  # handles re-read the repaired log
        return findings

    def _still_named(self, entry: CatalogEntry) -> bool:
        """True when the catalog still names the entry's table (a delete removes the entry before the table)."""
        still = self.broker.catalog.get(entry.name)
        return still is not None and still.table_path == entry.table_path

    def _check_action_fits(self, topic_name: str, subscription_name: str, action: Any) -> None:
        """Refuse an action whose copies the subscription could never deliver (EntityNotFoundError if it does not exist)."""
        sub = self.get_subscription(topic_name, subscription_name)
        name = Address.subscription_of(topic_name, subscription_name).path
        check_session_action(action, bool(sub.requires_session), sub.partition_count, name)

    def _no_rule_changes_in_transaction(self) -> None:
        refuse_in_transaction(self.broker, "subscription rules cannot be added or removed inside a transaction")

    def _check_destinations(
        self,
        settings: dict[str, Any],
        queue_name: str | None = None,
        current: EntityProperties | None = None,
        *,
        topic_name: str | None = None,
    ) -> None:
        """Forwarding destinations must name an existing queue or topic, as in Service Bus (docs/semantics.md §9).

        A queue may not forward its messages to itself, nor a subscription (of `topic_name`) to its own
        topic, in any spelling: every message would circle (a subscription's, multiplied by the topic's
        other subscriptions) until its hop count dead-lettered it; dead letters may go back. An update may keep a destination
        the entity already has (`current`) even if it was deleted since: its messages dead-letter until it is back.
        """
        own = queue_name if queue_name is not None else topic_name
        for k in ("forward_to", "forward_dead_lettered_messages_to"):
            target = settings.get(k)
            if target is None:
                continue
            limits.check_entity_name(target, k)
            itself = own is not None and target.lower() == own.lower()
            if itself and k == "forward_to":
                whose = f"queue {queue_name!r}" if queue_name is not None else f"a subscription of topic {topic_name!r}"
                raise InvalidOperationError(
                    f"{whose} cannot forward its messages to {'itself' if queue_name is not None else 'that topic'} (forward_to)"
                )
            kept = current is not None and target.lower() == (getattr(current, k) or "").lower()
            if not (itself or kept):
                self._require_destination(k, target)

    def _require_destination(self, setting: str, target: str) -> None:
        """EntityNotFoundError unless a queue or topic is named `target` (in any case): a forward's destination."""
        for kind in (QUEUE, TOPIC):
            with contextlib.suppress(EntityNotFoundError):
                self.broker.entry(kind, target)
                return
        topic, sub = Address.split_path(target)
        pair = (topic, sub) if sub is not None else Address.split_short(target)
        if pair is not None:
            with contextlib.suppress(EntityNotFoundError):
                self.broker.entry(SUBSCRIPTION, sub_entity_name(*pair))
                raise InvalidOperationError(
                    f"{setting} names subscription {target!r}: messages are forwarded to a queue or topic "
                    f"(forward to topic {pair[0]!r}, whose rules decide its subscriptions; nothing was changed)"
                )
        raise EntityNotFoundError(
            f"{setting} names {target!r}, but no queue or topic of that name exists in namespace {self.broker.root!r}; "
            "create the destination first (nothing was changed)"
        )


def _new_route(old: EntityProperties, new: EntityProperties) -> bool:
    """True when an update sets a forwarding destination the entity did not have (either route)."""
    return any(
        getattr(new, f, None) and getattr(new, f, None) != getattr(old, f, None)
        for f in ("forward_to", "forward_dead_lettered_messages_to")
    )


def _left_destination(old: EntityProperties, new: EntityProperties) -> str | None:
    """The forward_to an update changes or removes (None when it keeps it)."""
    before = getattr(old, "forward_to", None)
    return before if before != getattr(new, "forward_to", None) else None


def _children_of(entity_type: str, name: str) -> Callable[[str], bool] | None:
    """Which catalog keys are the entity's children (a topic's subscriptions and rules); None for a queue.

    Catalog deletes test it on the rows their commit replaces, so a child created meanwhile goes too.
    """
    if entity_type == QUEUE:
        return None
    me = Address.of(entity_type, name)
    return lambda key: Address.parse(key).is_child_of(me)


def _stored_rule(flt: Any, action: Any) -> tuple[RuleFilter, SqlRuleAction | None]:
    """The filter and action as the catalog will hold them: of the SDK's types, rebuilt from their descriptions.

    Rebuilding (as reading the catalog does) checks fields changed after construction, so a stored rule always parses.
    """
    if not isinstance(flt, (SqlRuleFilter, CorrelationRuleFilter)):
        raise InvalidArgumentTypeError(
            f"filter must be a SqlRuleFilter, CorrelationRuleFilter, TrueRuleFilter or FalseRuleFilter, got {type(flt).__name__}"
        )
    if action is not None and not isinstance(action, SqlRuleAction):
        raise InvalidArgumentTypeError(f"action must be a SqlRuleAction or None, got {type(action).__name__}")
    rebuilt = filter_from_dict(flt.to_dict())
    _check_description(rebuilt.to_dict(), "the rule's filter")
    rebuilt_action = action_from_dict(action.to_dict()) if action is not None else None
    if rebuilt_action is not None:
        _check_description(rebuilt_action.to_dict(), "the rule's action")
    read = set(getattr(rebuilt, "system_properties", set)()) | (rebuilt_action.system_properties() if rebuilt_action else set())
    if "SequenceNumber" in read:  # docs/semantics.md §8
        raise FilterSyntaxError(
            "sys.SequenceNumber is assigned when each subscription stores its copy, after the topic's rules ran: "
            "a rule cannot read it"
        )
    return rebuilt, rebuilt_action


def _check_topic_quota(topic_name: str, catalog: list[CatalogEntry], adding: str) -> None:
    """QuotaExceededError when the topic holds as many subscriptions, or filters of a kind, as Service Bus allows.

    `adding`: SUBSCRIPTION, or a filter kind ("SqlRuleFilter" or "CorrelationRuleFilter"). Checked
    on the catalog a create's commit finds, so racing creates cannot pass the quota together.
    """
    of_topic = [e for e in catalog if Address.parse(e.name).topic == topic_name]
    if adding == SUBSCRIPTION:
        held = sum(1 for e in of_topic if e.entity_type == SUBSCRIPTION)
        quota = limits.MAX_SUBSCRIPTIONS_PER_TOPIC
    else:
        held = sum(1 for e in of_topic if e.entity_type == RULE and _filter_kind(json.loads(e.properties)["filter"]) == adding)
        quota = (
            limits.MAX_CORRELATION_FILTERS_PER_TOPIC if adding == "CorrelationRuleFilter" else limits.MAX_SQL_FILTERS_PER_TOPIC
        )
    if held >= quota:
        what = "subscriptions" if adding == SUBSCRIPTION else f"rules with a {_SHOWN_KIND[adding]} filter"
        raise QuotaExceededError(
            f"topic {topic_name!r} already holds {quota} {what}, as many as Service Bus allows; delete one first"
        )


_SHOWN_KIND = {"SqlRuleFilter": "SQL (or true or false)", "CorrelationRuleFilter": "correlation"}


def _filter_kind(description: Mapping[str, Any]) -> str:
    """A stored filter's quota kind: correlation filters have their own; true, false and SQL filters count together."""
    return "CorrelationRuleFilter" if description.get("type") == "CorrelationRuleFilter" else "SqlRuleFilter"


def _check_description(description: Mapping[str, Any], what: str) -> None:
    """A rule's filter or action as stored: UTF-8 strings of bounded length, in a bounded description.

    Fan-out builds Arrow strings from every value, for every send to the topic (a value is copied
    once per message), and the catalog holding every rule is rewritten at each change: a value of
    megabytes would slow every send and every management call of the namespace.
    """
    try:
        text = json.dumps(description, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOperationError(f"{what} contains characters with no UTF-8 form (lone surrogates)") from None
    longest = max(_strings(description), key=len, default="")
    if len(longest) > limits.MAX_RULE_TEXT:
        raise InvalidOperationError(
            f"{what} holds a name or value of {len(longest)} characters ({longest[:40]!r}...); "
            f"at most {limits.MAX_RULE_TEXT} are allowed"
        )
    if len(text) > limits.MAX_RULE_BYTES:
        raise InvalidOperationError(f"{what} takes {len(text)} bytes to describe; at most {limits.MAX_RULE_BYTES} are allowed")


def _strings(value: object) -> Iterator[str]:
    """Every string in a JSON-like description: keys and values, nested."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _refuse_other_than_topic(field: str, value: object, topic: TopicProperties) -> None:
    """InvalidOperationError unless a subscription's `field` is its topic's (its copies live in the topic's table)."""
    if value != getattr(topic, field):
        how = "change it with update_topic" if field == "max_size_in_megabytes" else "it is fixed when the topic is created"
        raise InvalidOperationError(f"a subscription's {field} is its topic's ({getattr(topic, field)!r}; {how}), got {value!r}")


def _sized_as(props: SubscriptionProperties, topic: TopicProperties) -> SubscriptionProperties:
    """A subscription's settings showing its topic's current size, the one that applies (recorded at creation, it goes stale)."""
    return dataclasses.replace(props, max_size_in_megabytes=topic.max_size_in_megabytes)


def _rule_json(flt: Any, action: Any) -> str:
    """A rule's catalog JSON."""
    return json.dumps({"filter": flt.to_dict(), "action": action.to_dict() if action is not None else None}, allow_nan=False)


def _with_timeout(method: Callable[..., Any]) -> Callable[..., Any]:
    """Accept the SDK's per-call `timeout=` keyword on a management call: it bounds the call (see model.deadlines)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        with call_timeout(timeout):
            return method(self, *args, **kwargs)

    return call


def _with_stored_names(method: Callable[..., Any]) -> Callable[..., Any]:
    """Read the entity and rule names a management call is given as stored, if they differ only in case.

    Service Bus names ignore case (Broker.canonical). A create keeps the spelling it is given for the entity it creates.
    """
    signature = inspect.signature(method)
    names = [n for n in ("queue_name", "topic_name", "subscription_name", "rule_name") if n in signature.parameters]
    if not names:
        return method
    created = method.__name__.removeprefix("create_") + "_name" if method.__name__.startswith("create_") else None

    @functools.wraps(method)
    def call(self: Management, *args: Any, **kwargs: Any) -> Any:
        _refuse_given_twice(method.__name__, signature, args, kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return method(self, *args, **kwargs)  # Python's own error for a wrong call
        given = bound.arguments
        with contextlib.suppress(SparkQueueError):  # an invalid name: the call itself reports it
            _store_names(self.broker, given, created)
        return method(*bound.args, **bound.kwargs)

    return call


def _refuse_given_twice(method: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a keyword that repeats a name given by position (as a settings dict holding topic_name would), clearly."""
    positional = [p.name for p in signature.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][1 : 1 + len(args)]
    twice = [n for n in positional if n in kwargs]
    if twice:
        raise InvalidArgumentTypeError(
            f"{method}() got {twice[0]!r} both as an argument and as a keyword; "
            "it is not a setting: pass it once (as the argument)"
        )


def _store_names(broker: Broker, given: dict[str, Any], created: str | None) -> None:
    """Replace the names in a call's arguments by their stored spelling (see _with_stored_names).

    A name no entity can have (limits.check_name_type) raises here, before any catalog lookup.
    """
    queue, topic, sub = given.get("queue_name"), given.get("topic_name"), given.get("subscription_name")
    rule = given.get("rule_name")
    for name, what in ((queue, QUEUE), (topic, TOPIC), (sub, SUBSCRIPTION), (rule, RULE)):
        if isinstance(name, str):
            limits.check_name_type(name, what)
    if isinstance(queue, str) and created != "queue_name":
        given["queue_name"] = broker.canonical(QUEUE, queue)
    if not isinstance(topic, str):
        return
    if created != "topic_name":
        given["topic_name"] = topic = broker.canonical(TOPIC, topic)
    if not isinstance(sub, str):
        return
    if created != "subscription_name":
        given["subscription_name"] = sub = Address.of(
            SUBSCRIPTION, broker.canonical(SUBSCRIPTION, sub_entity_name(topic, sub))
        ).leaf
    if isinstance(rule, str) and created != "rule_name":
        given["rule_name"] = Address.of(RULE, broker.canonical(RULE, rule_entity_name(topic, sub, rule))).leaf


for _name, _method in list(vars(Management).items()):
    if not _name.startswith("_") and callable(_method):
        setattr(Management, _name, _with_timeout(_with_stored_names(_method)))


def _same_entity_name(entity_type: str, name: str) -> Callable[[str], bool]:
    """Whether a catalog key names an entity `name` would clash with, ignoring case (Service Bus names ignore it).

    Queues and topics share one name space; a subscription's name is unique among its topic's subscriptions, and a
    rule's among its subscription's rules (the subscription as stored: `create_rule` is given its stored spelling).
    """
    wanted = Address.of(entity_type, name)
    kinds = (QUEUE, TOPIC) if entity_type in (QUEUE, TOPIC) else (entity_type,)

    def same(key: str) -> bool:
        taken = Address.parse(key)
        if taken.kind not in kinds:
            return False
        if entity_type == RULE and taken.parts[:-1] != wanted.parts[:-1]:
            return False  # another subscription's rule (subscriptions made before names ignored case may differ by case)
        return taken.name.lower() == wanted.name.lower()

    return same


def _listed(fetch: Callable[[], RuntimeProperties], props: EntityProperties) -> RuntimeProperties:
    """An entity's runtime properties for a list: one whose table cannot be read is listed, not the list failed.

    It comes with availability "Unknown", every partition unavailable and no count (the CLI shows "≥0"); getting its
    runtime properties alone raises the error (docs/semantics.md §10).
    """
    try:
        return fetch()
    except StorageCorruptedError as exc:  # damage to this entity's table; a store that cannot be reached still raises
        log.warning("runtime properties of %s %r could not be read: %s", props.entity_type, props.name, exc)
        parts = [PartitionRuntimeProperties(partition_id=p, available=False) for p in range(props.partition_count)]
        out = RuntimeProperties.aggregate(props.name, parts)
        out.availability_status = "Unknown"
        return out
