"""Entity addresses (model/addresses.py): the one reader and writer of catalog keys."""

from __future__ import annotations

import pytest

from sparkqueue.model.addresses import QUEUE, RULE, SUBSCRIPTION, TOPIC, Address


@pytest.mark.parametrize(
    "key",
    ["queue:orders", "topic:orders", "subscription:orders|audit", "rule:orders|audit|$Default", "queue:a.b-c_d/e"],
)
def test_keys_round_trip(key: str) -> None:
    """Parsing a catalog key and spelling it again gives the same key."""
    assert Address.parse(key).key == key


def test_parts_of_a_rule_and_its_owners() -> None:
    """A rule names its topic, subscription and itself; its owner is the topic."""
    rule = Address.rule_of("orders", "audit", "$Default")
    assert (rule.kind, rule.topic, rule.subscription, rule.leaf) == (RULE, "orders", "audit", "$Default")
    assert rule.owner() == Address(TOPIC, ("orders",))
    assert Address.subscription_of("orders", "audit").owner().key == "topic:orders"
    assert Address.of(QUEUE, "q").owner() == Address.of(QUEUE, "q")


def test_children_are_found_by_parts_not_by_string_prefix() -> None:
    """A topic's children are its subscriptions and rules, not those of a topic whose name merely starts alike."""
    topic = Address.of(TOPIC, "orders")
    assert Address.subscription_of("orders", "audit").is_child_of(topic)
    assert Address.rule_of("orders", "audit", "r").is_child_of(Address.subscription_of("orders", "audit"))
    assert not Address.subscription_of("orders2", "audit").is_child_of(topic)
    assert not Address.subscription_of("orders", "audit2").is_child_of(Address.subscription_of("orders", "audit"))
    assert not topic.is_child_of(topic)
    assert Address.of(SUBSCRIPTION, "orders|audit") == Address.subscription_of("orders", "audit")


def test_service_bus_paths_are_written_and_read_in_one_place() -> None:
    """Users name entities by Service Bus paths; Address writes them and splits a user's path."""
    assert Address.of(QUEUE, "orders").path == "orders"
    assert Address.subscription_of("orders", "audit").path == "orders/Subscriptions/audit"
    assert Address.rule_of("orders", "audit", "$Default").path == "orders/Subscriptions/audit/Rules/$Default"
    assert Address.split_path("orders/Subscriptions/audit") == ("orders", "audit")
    assert Address.split_path("Orders/subscriptions/Audit") == ("Orders", "Audit")  # names and segments in any case
    assert Address.split_path("orders") == ("orders", None)
    sub = Address.subscription_of("orders", "audit")
    assert Address.split_path(sub.path) == (sub.topic, sub.subscription)
