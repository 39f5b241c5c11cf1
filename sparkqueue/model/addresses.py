"""Typed entity addresses: an entity's kind and the names that place it (topic, subscription, rule).

The catalog keys each entity by a string `"<kind>:<name>"`, the name joining a subscription or a
rule to its topic with '|' ("subscription:orders|audit", "rule:orders|audit|$Default"); entity
names may not contain '|' (model/limits.py refuses it in every name given, to a creation or a
lookup). This module is the one place that builds and reads those strings.
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUE, TOPIC, SUBSCRIPTION, RULE = "queue", "topic", "subscription", "rule"
KINDS = (QUEUE, TOPIC, SUBSCRIPTION, RULE)
SEPARATOR = "|"
SUBSCRIPTIONS, RULES = "/Subscriptions/", "/Rules/"  # Service Bus path segments ("orders/Subscriptions/audit")


@dataclass(frozen=True)
class Address:
    """An entity's kind and its name parts: (queue,), (topic,), (topic, subscription) or (topic, subscription, rule)."""

    kind: str
    parts: tuple[str, ...]

    @classmethod
    def of(cls, kind: str, name: str) -> Address:
        """The address of an entity named as the catalog names it ("t|s" for a subscription)."""
        return cls(kind, tuple(name.split(SEPARATOR)))

    @classmethod
    def parse(cls, key: str) -> Address:
        """The address a catalog key spells."""
        kind, _, name = key.partition(":")
        return cls.of(kind, name)

    @classmethod
    def subscription_of(cls, topic: str, subscription: str) -> Address:
        """A subscription's address."""
        return cls(SUBSCRIPTION, (topic, subscription))

    @classmethod
    def rule_of(cls, topic: str, subscription: str, rule: str) -> Address:
        """A rule's address."""
        return cls(RULE, (topic, subscription, rule))

    @property
    def name(self) -> str:
        """The name as the catalog stores it after the kind ("t|s" for a subscription)."""
        return SEPARATOR.join(self.parts)

    @classmethod
    def split_path(cls, path: str) -> tuple[str, str | None]:
        """A user's entity path as (queue or topic name, subscription or None): "t/Subscriptions/s" names a subscription.

        The segment is matched in any case, as names are ("t/subscriptions/s" too).
        """
        at = path.lower().find(SUBSCRIPTIONS.lower())
        return (path[:at], path[at + len(SUBSCRIPTIONS) :]) if at >= 0 else (path, None)

    @staticmethod
    def split_short(name: str) -> tuple[str, str] | None:
        """The (topic, subscription) the short "t/s" form may spell, or None: split at the last '/'.

        Queue names may hold '/', so a caller tries a queue of that name first.
        """
        topic, slash, sub = name.rpartition("/")
        return (topic, sub) if slash and topic and sub else None

    @property
    def path(self) -> str:
        """The name as users write it, in Service Bus path form ("t/Subscriptions/s", "t/Subscriptions/s/Rules/r")."""
        return "".join(sep + part for sep, part in zip(("", SUBSCRIPTIONS, RULES), self.parts, strict=False))

    @property
    def key(self) -> str:
        """The catalog key."""
        return f"{self.kind}:{self.name}"

    @property
    def topic(self) -> str:
        """The queue's or topic's name (a subscription's or rule's topic)."""
        return self.parts[0]

    @property
    def subscription(self) -> str | None:
        """The subscription's name, for a subscription or a rule."""
        return self.parts[1] if len(self.parts) > 1 else None

    @property
    def leaf(self) -> str:
        """The entity's own name (the rule's name for a rule)."""
        return self.parts[-1]

    def owner(self) -> Address:
        """The queue or topic the entity belongs to (itself for a queue or topic)."""
        return Address(TOPIC, self.parts[:1]) if len(self.parts) > 1 else self

    def children_prefix(self) -> str:
        """What the catalog names of this entity's children (subscriptions, rules) start with."""
        return self.name + SEPARATOR

    def is_child_of(self, parent: Address) -> bool:
        """True for a subscription or rule below `parent` (a topic or subscription)."""
        return len(self.parts) > len(parent.parts) and self.parts[: len(parent.parts)] == parent.parts
