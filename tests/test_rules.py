"""Subscription rules end to end through topics (docs/semantics.md §7, §8): management, every filter construct, actions."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from procs import peek_all

from sparkqueue import (
    CorrelationRuleFilter,
    FalseRuleFilter,
    Message,
    Namespace,
    SqlRuleAction,
    SqlRuleFilter,
    SubQueue,
    TrueRuleFilter,
)
from sparkqueue.errors import (
    EntityAlreadyExistsError,
    EntityNotFoundError,
    FilterSyntaxError,
    InvalidOperationError,
)
from sparkqueue.model.sql_parser import stored_rules

# Five messages that exercise the filter constructs; each subscription below names the ids it must get.
MESSAGES = [
    Message(
        "1",
        message_id="m1",
        subject="orders",
        correlation_id="c1",
        content_type="json",
        to="shop",
        reply_to="r",
        application_properties={"color": "red", "qty": 5, "price": 2.5, "region": "EU", "flag": True},
    ),
    Message(
        "2",
        message_id="m2",
        subject="invoice",
        correlation_id="c2",
        application_properties={"color": "blue", "qty": 12, "price": 10.0, "region": "US", "note": None},
    ),
    Message("3", message_id="m3", subject="order_x", application_properties={"color": "green", "qty": "5"}),
    Message("4", message_id="m4"),
    Message("5", message_id="m5", reply_to_session_id="rs", application_properties={"color": "Red", "qty": 0, "region": "APAC"}),
]
ALL = {"m1", "m2", "m3", "m4", "m5"}

FILTER_CASES: list[tuple[str, Any, set[str]]] = [
    ("sys-label", SqlRuleFilter("sys.Label = 'orders'"), {"m1"}),
    ("sys-label-like", SqlRuleFilter("sys.Label LIKE 'order%'"), {"m1", "m3"}),
    ("like-escape", SqlRuleFilter("sys.Label LIKE 'order!_%' ESCAPE '!'"), {"m3"}),
    ("like-underscore", SqlRuleFilter("color LIKE 'r_d'"), {"m1"}),
    ("not-like", SqlRuleFilter("color NOT LIKE '%r%'"), {"m2", "m5"}),
    ("sys-messageid-in", SqlRuleFilter("sys.MessageId IN ('m2', 'm4', 'zz')"), {"m2", "m4"}),
    ("app-eq-case-sensitive", SqlRuleFilter("color = 'red'"), {"m1"}),
    ("user-prefix", SqlRuleFilter("user.color = 'blue'"), {"m2"}),
    ("in", SqlRuleFilter("region IN ('EU', 'APAC')"), {"m1", "m5"}),
    ("not-in", SqlRuleFilter("region NOT IN ('EU')"), {"m2", "m5"}),
    ("is-null", SqlRuleFilter("region IS NULL"), {"m3", "m4"}),
    ("sys-is-not-null", SqlRuleFilter("sys.CorrelationId IS NOT NULL"), {"m1", "m2"}),
    ("exists", SqlRuleFilter("EXISTS(note)"), {"m2"}),
    ("not-exists", SqlRuleFilter("NOT EXISTS(color)"), {"m4"}),
    ("arith-mul", SqlRuleFilter("qty * price > 20"), {"m2"}),
    ("arith-mod-sub", SqlRuleFilter("qty % 5 = 0 AND qty - 1 >= 0"), {"m1"}),
    ("arith-div-add", SqlRuleFilter("(qty + 3) / 2 = 7 OR (qty + 3) / 2.0 = 4.0"), {"m2", "m1"}),
    ("typed-number", SqlRuleFilter("qty = 5"), {"m1"}),
    ("typed-string", SqlRuleFilter("qty = '5'"), {"m3"}),
    ("bool", SqlRuleFilter("flag = TRUE"), {"m1"}),
    ("not-and-or", SqlRuleFilter("NOT (color = 'red') AND (qty > 1 OR flag = TRUE)"), {"m2"}),
    ("comparison-ops", SqlRuleFilter("qty >= 5 AND qty <> 12 AND price < 3 AND price <= 2.5"), {"m1"}),
    ("sys-reply-to-session", SqlRuleFilter("sys.ReplyToSessionId = 'rs'"), {"m5"}),
    ("sys-to-content-type", SqlRuleFilter("sys.To = 'shop' AND sys.ContentType = 'json' AND sys.ReplyTo = 'r'"), {"m1"}),
    ("parameter", SqlRuleFilter("color = @c", parameters={"@c": "green"}), {"m3"}),
    (
        "correlation-full",
        CorrelationRuleFilter(correlation_id="c1", label="orders", properties={"color": "red", "qty": 5}),
        {"m1"},
    ),
    ("correlation-typed-property", CorrelationRuleFilter(properties={"qty": 5}), {"m1"}),
    ("correlation-fields", CorrelationRuleFilter(to="shop", content_type="json", reply_to="r"), {"m1"}),
    ("correlation-message-id", CorrelationRuleFilter(message_id="m4"), {"m4"}),
    ("correlation-reply-to-session", CorrelationRuleFilter(reply_to_session_id="rs", properties={"region": "APAC"}), {"m5"}),
    ("correlation-no-match", CorrelationRuleFilter(correlation_id="c1", properties={"color": "blue"}), set()),
    ("true", TrueRuleFilter(), ALL),
    ("false", FalseRuleFilter(), set()),
    ("sql-true", SqlRuleFilter("1=1"), ALL),
]


def ids_in(ns: Namespace, topic: str, sub: str) -> Counter[str]:
    """message_id -> number of copies a subscription holds."""
    with ns.get_subscription_receiver(topic, sub) as r:
        return Counter(m.message_id for m in peek_all(r))


def subscribe(ns: Namespace, topic: str, sub: str, rules: dict[str, tuple[Any, Any]]) -> None:
    """Create a subscription whose rules are exactly `rules` (name -> (filter, action))."""
    ns.create_subscription(topic, sub)
    for name, (flt, action) in rules.items():
        ns.create_rule(topic, sub, name, filter=flt, action=action)
    ns.delete_rule(topic, sub, "$Default")


# ---- management -----------------------------------------------------------------------------------


def test_new_subscription_has_default_true_rule(ns: Namespace) -> None:
    """A new subscription has exactly the rule $Default with a true filter and no action."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    rules = ns.list_rules("t", "s")
    assert [r.name for r in rules] == ["$Default"]
    rule = ns.get_rule("t", "s", "$Default")
    assert rule.name == "$Default"
    assert isinstance(rule.filter, TrueRuleFilter)
    assert rule.action is None


def test_rule_round_trip(ns: Namespace) -> None:
    """create_rule stores filter and action; get_rule and list_rules return them."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    created = ns.create_rule(
        "t", "s", "sql", filter=SqlRuleFilter("color = @c", parameters={"@c": "red"}), action=SqlRuleAction("SET seen = 1")
    )
    assert created.name == "sql"
    ns.create_rule("t", "s", "corr", filter=CorrelationRuleFilter(correlation_id="c", properties={"n": 1, "b": True}))
    ns.create_rule("t", "s", "never", filter=FalseRuleFilter())
    ns.create_rule("t", "s", "default-filter")
    assert sorted(r.name for r in ns.list_rules("t", "s")) == ["$Default", "corr", "default-filter", "never", "sql"]
    sql = ns.get_rule("t", "s", "sql")
    assert isinstance(sql.filter, SqlRuleFilter)
    assert (sql.filter.sql_expression, sql.filter.parameters) == ("color = @c", {"@c": "red"})
    assert isinstance(sql.action, SqlRuleAction) and sql.action.sql_expression == "SET seen = 1"
    corr = ns.get_rule("t", "s", "corr")
    assert isinstance(corr.filter, CorrelationRuleFilter)
    assert (corr.filter.correlation_id, corr.filter.properties) == ("c", {"n": 1, "b": True})
    assert corr.action is None
    assert isinstance(ns.get_rule("t", "s", "never").filter, FalseRuleFilter)
    assert isinstance(ns.get_rule("t", "s", "default-filter").filter, TrueRuleFilter)


def test_rule_errors(ns: Namespace) -> None:
    """Rules on missing entities raise EntityNotFoundError; repeated names raise EntityAlreadyExistsError."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(EntityNotFoundError):
        ns.create_rule("t", "missing", "r", filter=TrueRuleFilter())
    with pytest.raises(EntityNotFoundError):
        ns.create_rule("missing", "s", "r", filter=TrueRuleFilter())
    with pytest.raises(EntityNotFoundError):
        ns.get_rule("t", "s", "nope")
    with pytest.raises(EntityNotFoundError):
        ns.delete_rule("t", "s", "nope")
    with pytest.raises(EntityNotFoundError):
        ns.list_rules("t", "missing")
    ns.create_rule("t", "s", "r", filter=SqlRuleFilter("a = 1"))
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_rule("t", "s", "r", filter=SqlRuleFilter("a = 2"))
    with pytest.raises(EntityAlreadyExistsError):
        ns.create_rule("t", "s", "$Default", filter=FalseRuleFilter())
    assert ns.get_rule("t", "s", "r").filter.sql_expression == "a = 1"
    ns.delete_rule("t", "s", "r")
    with pytest.raises(EntityNotFoundError):
        ns.delete_rule("t", "s", "r")
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


@pytest.mark.parametrize("name", ["", "a/b", "a|b", "x" * 51, "a b", "-r", None, 5])
def test_invalid_rule_names(ns: Namespace, name: object) -> None:
    """Invalid rule names raise InvalidOperationError and add no rule."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError):
        ns.create_rule("t", "s", name, filter=TrueRuleFilter())  # type: ignore[arg-type]
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


@pytest.mark.parametrize(
    ("flt", "action"),
    [
        ("color = 'red'", None),
        ({"type": "TrueRuleFilter"}, None),
        (42, None),
        (SqlRuleAction("SET a = 1"), None),
        (TrueRuleFilter(), "SET a = 1"),
        (TrueRuleFilter(), SqlRuleFilter("a = 1")),
        (TrueRuleFilter(), CorrelationRuleFilter(label="x")),
    ],
    ids=["str", "dict", "int", "action-as-filter", "str-action", "filter-as-action", "correlation-as-action"],
)
def test_bad_filter_or_action_objects(ns: Namespace, flt: object, action: object) -> None:
    """A filter or action of the wrong kind raises InvalidOperationError at creation; the topic keeps working."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError):
        ns.create_rule("t", "s", "bad", filter=flt, action=action)
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    ns.get_topic_sender("t").send_messages(Message("x", message_id="after"))
    assert ids_in(ns, "t", "s") == Counter({"after": 1})


@pytest.mark.parametrize(
    "make",
    [
        lambda: SqlRuleFilter("color = = 'red'"),
        lambda: SqlRuleFilter("color IN ()"),
        lambda: SqlRuleFilter("(a = 1"),
        lambda: SqlRuleFilter("a = 'unterminated"),
        lambda: SqlRuleFilter("a LIKE"),
        lambda: SqlRuleFilter("sys.NoSuchProperty = 1"),
        lambda: SqlRuleFilter("a = @missing"),
        lambda: SqlRuleAction("SET"),
        lambda: SqlRuleAction("SET a 1"),
        lambda: SqlRuleAction("DROP a"),
    ],
    ids=["double-eq", "empty-in", "paren", "string", "like", "sys-unknown", "parameter", "set", "set-no-eq", "unknown-stmt"],
)
def test_invalid_sql_fails_at_rule_creation(ns: Namespace, make: Any) -> None:
    """Invalid SQL raises FilterSyntaxError (an InvalidOperationError) at rule creation and adds no rule."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(FilterSyntaxError) as err:
        made = make()
        if isinstance(made, SqlRuleAction):
            ns.create_rule("t", "s", "bad", filter=TrueRuleFilter(), action=made)
        else:
            ns.create_rule("t", "s", "bad", filter=made)
    assert isinstance(err.value, InvalidOperationError)
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def test_rules_cannot_change_inside_a_transaction(ns: Namespace) -> None:
    """Adding or removing a rule inside a transaction raises InvalidOperationError and changes nothing."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError), ns.transaction():
        ns.create_rule("t", "s", "r", filter=TrueRuleFilter())
    with pytest.raises(InvalidOperationError), ns.transaction():
        ns.delete_rule("t", "s", "$Default")
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def test_rule_changes_apply_to_later_sends(ns: Namespace) -> None:
    """Adding and deleting rules changes what later sends deliver; earlier copies stay."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    sender = ns.get_topic_sender("t")
    sender.send_messages(Message("a", message_id="1", application_properties={"k": 1}))
    ns.delete_rule("t", "s", "$Default")
    sender.send_messages(Message("b", message_id="2", application_properties={"k": 1}))  # no rule: nothing
    ns.create_rule("t", "s", "k2", filter=SqlRuleFilter("k = 2"))
    sender.send_messages([Message(f"{k}", message_id=f"k{k}", application_properties={"k": k}) for k in (1, 2)])
    ns.delete_rule("t", "s", "k2")
    ns.create_rule("t", "s", "k1", filter=CorrelationRuleFilter(properties={"k": 1}))
    sender.send_messages([Message(f"{k}", message_id=f"again{k}", application_properties={"k": k}) for k in (1, 2)])
    assert ids_in(ns, "t", "s") == Counter({"1": 1, "k2": 1, "again1": 1})


def test_rule_changes_seen_by_another_namespace_instance(root: str) -> None:
    """A rule added through one Namespace object filters sends made through another (a different client)."""
    with Namespace(root) as admin, Namespace(root) as client:
        admin.create_topic("t")
        admin.create_subscription("t", "s")
        sender = client.get_topic_sender("t")
        sender.send_messages(Message("x", message_id="before", application_properties={"ok": False}))
        admin.create_rule("t", "s", "ok", filter=SqlRuleFilter("ok = TRUE"))
        admin.delete_rule("t", "s", "$Default")
        time.sleep(1.1)  # clients may cache rules for up to PROPERTIES_TTL_S (1 s)
        sender.send_messages(
            [
                Message("x", message_id="rejected", application_properties={"ok": False}),
                Message("y", message_id="accepted", application_properties={"ok": True}),
            ]
        )
        assert ids_in(admin, "t", "s") == Counter({"before": 1, "accepted": 1})


# ---- every filter construct through a topic ---------------------------------------------------------


def test_every_filter_construct_end_to_end(ns: Namespace) -> None:
    """Every filter construct (sys.*, properties, IN, LIKE, IS NULL, EXISTS, arithmetic, correlation, true/false) works."""
    ns.create_topic("t")
    # one rule per construct, each tagging its own copy, so one subscription shows what every filter selected
    subscribe(ns, "t", "s", {name: (flt, SqlRuleAction(f"SET via = '{name}'")) for name, flt, _ in FILTER_CASES})
    ns.get_topic_sender("t").send_messages(MESSAGES)
    with ns.get_subscription_receiver("t", "s") as r:
        copies = peek_all(r)
    got: dict[str, Counter[str]] = {name: Counter() for name, _, _ in FILTER_CASES}
    for m in copies:
        got[(m.application_properties or {})["via"]][m.message_id] += 1
    want = {name: Counter(dict.fromkeys(expected, 1)) for name, _, expected in FILTER_CASES}
    assert got == want


def test_filters_on_unpartitioned_topic_and_many_batches(ns: Namespace) -> None:
    """Filters give the same selection when messages arrive one at a time on an unpartitioned topic."""
    ns.create_topic("t", enable_partitioning=False)
    cases = [c for c in FILTER_CASES if c[0] in {"in", "is-null", "exists", "arith-mul", "correlation-full", "sys-label-like"}]
    for name, flt, _ in cases:
        subscribe(ns, "t", name, {"only": (flt, None)})
    sender = ns.get_topic_sender("t")
    for m in MESSAGES:
        sender.send_messages(m)
    for name, _, expected in cases:
        assert ids_in(ns, "t", name) == Counter(dict.fromkeys(expected, 1)), name


def test_filters_do_not_read_the_body(ns: Namespace) -> None:
    """Filters see properties only: a body that looks like properties does not match."""
    ns.create_topic("t")
    subscribe(ns, "t", "s", {"only": (SqlRuleFilter("color = 'red'"), None)})
    ns.get_topic_sender("t").send_messages(
        [Message('{"color": "red"}', message_id="body"), Message("x", message_id="prop", application_properties={"color": "red"})]
    )
    assert ids_in(ns, "t", "s") == Counter({"prop": 1})


# ---- actions -----------------------------------------------------------------------------------------


def test_copies_per_rule_and_action(ns: Namespace) -> None:
    """Each matching rule with an action gives its own modified copy; matching rules without action give one copy between them."""
    ns.create_topic("t")
    subscribe(
        ns,
        "t",
        "s",
        {
            "red": (SqlRuleFilter("color = 'red'"), SqlRuleAction("SET tag = 'red'")),
            "many": (SqlRuleFilter("qty > 1"), SqlRuleAction("SET tag = 'many'; SET qty = qty * 2")),
            "region": (SqlRuleFilter("region IS NOT NULL"), None),
            "label": (SqlRuleFilter("sys.Label LIKE 'order%'"), None),
        },
    )
    ns.create_subscription("t", "plain")
    ns.get_topic_sender("t").send_messages(MESSAGES)
    with ns.get_subscription_receiver("t", "s") as r:
        copies = peek_all(r)
    by_id: dict[str, list[dict[str, Any] | None]] = {}
    for m in copies:
        by_id.setdefault(m.message_id, []).append(m.application_properties)
    assert Counter({k: len(v) for k, v in by_id.items()}) == Counter({"m1": 3, "m2": 2, "m3": 1, "m5": 1})
    m1 = MESSAGES[0].application_properties
    m2 = MESSAGES[1].application_properties
    assert m1 is not None and m2 is not None

    def key(p: dict[str, Any] | None) -> str:
        return repr(sorted((p or {}).items()))

    assert sorted(by_id["m1"], key=key) == sorted(
        [{**m1, "tag": "red", "RuleName": "red"}, {**m1, "tag": "many", "qty": 10, "RuleName": "many"}, m1],
        key=key,
    )
    assert sorted(by_id["m2"], key=key) == sorted([{**m2, "tag": "many", "qty": 24, "RuleName": "many"}, m2], key=key)
    assert by_id["m3"] == [MESSAGES[2].application_properties]
    # the copies of other subscriptions are not modified
    with ns.get_subscription_receiver("t", "plain") as r:
        plain = {m.message_id: m.application_properties for m in peek_all(r)}
    assert plain["m1"] == m1 and plain["m2"] == m2


def test_action_remove_and_system_property(ns: Namespace) -> None:
    """Actions can REMOVE properties and SET system properties such as sys.Label on the copy."""
    ns.create_topic("t")
    subscribe(
        ns,
        "t",
        "s",
        {"r": (TrueRuleFilter(), SqlRuleAction("REMOVE color; SET sys.Label = 'relabelled'; SET total = qty * price"))},
    )
    ns.get_topic_sender("t").send_messages(MESSAGES[:2])
    with ns.get_subscription_receiver("t", "s") as r:
        got = {m.message_id: m for m in peek_all(r)}
    assert set(got) == {"m1", "m2"}
    assert got["m1"].subject == "relabelled"
    common = {"RuleName": "r"}
    assert got["m1"].application_properties == {"qty": 5, "price": 2.5, "region": "EU", "flag": True, "total": 12.5, **common}
    assert got["m2"].application_properties == {"qty": 12, "price": 10.0, "region": "US", "note": None, "total": 120.0, **common}
    assert got["m1"].body == b"1"


def test_two_subscriptions_two_actions_each(ns: Namespace) -> None:
    """Copy counts add up over subscriptions: N messages x matching action rules, per subscription."""
    ns.create_topic("t")
    for sub in ("a", "b"):
        subscribe(
            ns,
            "t",
            sub,
            {
                "x": (TrueRuleFilter(), SqlRuleAction(f"SET via = '{sub}-x'")),
                "y": (SqlRuleFilter("n < 5"), SqlRuleAction(f"SET via = '{sub}-y'")),
            },
        )
    seqs = ns.get_topic_sender("t").send_messages(
        [Message(f"{i}", message_id=f"m{i}", application_properties={"n": i}) for i in range(10)]
    )
    assert len(seqs) == 2 * (10 + 5)
    for sub in ("a", "b"):
        with ns.get_subscription_receiver("t", sub) as r:
            via = Counter((m.application_properties or {}).get("via") for m in peek_all(r))
        assert via == Counter({f"{sub}-x": 10, f"{sub}-y": 5})


def runtime_counts(ns: Namespace, topic: str, sub: str) -> tuple[int, int]:
    """(active, scheduled) message counts of a subscription."""
    props = ns.get_subscription_runtime_properties(topic, sub)
    return props.active_message_count, props.scheduled_message_count


def test_action_scheduled_time_decides_when_the_copy_is_visible(ns: Namespace) -> None:
    """SET or REMOVE sys.ScheduledEnqueueTimeUtc moves the copy's enqueue and expiry time, as a send with that schedule would,
    but never earlier than the message's own schedule (REMOVE or a past time made a scheduled message's copy receivable)."""
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5)
    own = later + timedelta(hours=1)
    past = datetime(2020, 1, 1, tzinfo=UTC)
    ns.create_topic("t")
    subscribe(ns, "t", "later", {"r": (TrueRuleFilter(), SqlRuleAction("SET sys.ScheduledEnqueueTimeUtc = @at", {"@at": later}))})
    subscribe(ns, "t", "past", {"r": (TrueRuleFilter(), SqlRuleAction("SET sys.ScheduledEnqueueTimeUtc = @at", {"@at": past}))})
    subscribe(ns, "t", "unscheduled", {"r": (TrueRuleFilter(), SqlRuleAction("REMOVE sys.ScheduledEnqueueTimeUtc"))})
    sender = ns.get_topic_sender("t")
    sender.send_messages(Message("now", message_id="now", time_to_live=timedelta(hours=1)))
    sender.schedule_messages(Message("sched", message_id="sched", time_to_live=timedelta(hours=1)), own)

    assert runtime_counts(ns, "t", "later") == (0, 2)
    with ns.get_subscription_receiver("t", "later") as r:
        assert r.receive_messages(max_message_count=5, max_wait_time=0.2) == []
        copies = peek_all(r)
    times = {m.message_id: (m.scheduled_enqueue_time_utc, m.enqueued_time_utc, m.expires_at_utc) for m in copies}
    assert times == {"now": (later, later, later + timedelta(hours=1)), "sched": (own, own, own + timedelta(hours=1))}
    for sub in ("past", "unscheduled"):
        assert runtime_counts(ns, "t", sub) == (1, 1), sub
        with ns.get_subscription_receiver("t", sub) as r:
            got = r.receive_messages(max_message_count=5, max_wait_time=1)
            assert [m.message_id for m in got] == ["now"], sub
            assert got[0].enqueued_time_utc < later
            assert got[0].expires_at_utc == got[0].enqueued_time_utc + timedelta(hours=1)
            (sched,) = [m for m in peek_all(r) if m.message_id == "sched"]
        assert (sched.scheduled_enqueue_time_utc, sched.enqueued_time_utc, sched.expires_at_utc) == (
            own,
            own,
            own + timedelta(hours=1),
        ), sub


def test_an_action_postpones_a_copy_by_a_duration(ns: Namespace) -> None:
    """SET sys.ScheduledEnqueueTimeUtc = sys.EnqueuedTimeUtc + @d stored NULL: the copy meant to wait was receivable at once."""
    ns.create_topic("t")
    delay = SqlRuleAction("SET sys.ScheduledEnqueueTimeUtc = sys.EnqueuedTimeUtc + @d", {"d": timedelta(hours=1)})
    subscribe(ns, "t", "delayed", {"r": (TrueRuleFilter(), delay)})
    ttl_filter = SqlRuleFilter("sys.ExpiresAtUtc - sys.EnqueuedTimeUtc > @d", {"d": timedelta(minutes=5)})
    subscribe(ns, "t", "long-lived", {"r": (ttl_filter, None)})
    with ns.get_topic_sender("t") as s:
        s.send_messages(
            [
                Message("x", message_id="long", time_to_live=timedelta(hours=2)),
                Message("y", message_id="short", time_to_live=timedelta(minutes=1)),
            ]
        )
    assert ids_in(ns, "t", "long-lived") == Counter({"long": 1})
    assert runtime_counts(ns, "t", "delayed") == (0, 2)
    with ns.get_subscription_receiver("t", "delayed") as r:
        assert r.receive_messages(max_message_count=5, max_wait_time=0.2) == []
        copies = peek_all(r)
    assert all(m.enqueued_time_utc - datetime.now(UTC) > timedelta(minutes=55) for m in copies)


def test_an_action_setting_a_system_property_to_a_property_of_another_type_dead_letters_that_copy(ns: Namespace) -> None:
    """SET sys.TimeToLive = <a string> cleared the TTL: the copy never expired. Now it fails as a rule that raised."""
    ns.create_topic("t")
    subscribe(ns, "t", "s", {"r": (TrueRuleFilter(), SqlRuleAction("SET sys.TimeToLive = ttl"))})
    with ns.get_topic_sender("t") as s:
        s.send_messages(
            [
                Message("x", message_id="text", time_to_live=timedelta(seconds=30), application_properties={"ttl": "60000"}),
                Message("y", message_id="number", time_to_live=timedelta(seconds=30), application_properties={"ttl": 60000}),
            ]
        )
    with ns.get_subscription_receiver("t", "s") as r:
        (copy,) = peek_all(r)
    assert (copy.message_id, copy.time_to_live) == ("number", timedelta(minutes=1))
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        (dead,) = peek_all(r)
    assert (dead.message_id, dead.dead_letter_reason, dead.time_to_live) == (
        "text",
        "FilterEvaluationException",
        timedelta(seconds=30),
    )
    assert "sys.TimeToLive takes a number" in (dead.dead_letter_error_description or "")


@pytest.mark.parametrize(
    "sql",
    [
        "SET sys.TimeToLive = sys.Label",
        "SET sys.ScheduledEnqueueTimeUtc = sys.TimeToLive",
        "SET sys.TimeToLive = sys.EnqueuedTimeUtc + 1",
    ],
)
def test_an_action_setting_a_system_property_to_an_expression_of_another_type_is_refused(ns: Namespace, sql: str) -> None:
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(FilterSyntaxError, match="takes a"):
        ns.create_rule("t", "s", "bad", action=SqlRuleAction(sql))
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def test_copies_made_by_a_rule_with_an_action_carry_its_name_as_rule_name(ns: Namespace) -> None:
    """Service Bus topic filters: each rule with an action gives a copy whose property RuleName names the rule."""
    ns.create_topic("t")
    subscribe(
        ns,
        "t",
        "s",
        {
            "ruleA": (TrueRuleFilter(), SqlRuleAction("SET x = 1")),
            "ruleB": (TrueRuleFilter(), SqlRuleAction("SET x = 2; SET rulename = 'mine'")),
            "plain": (TrueRuleFilter(), None),
        },
    )
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x", message_id="m", application_properties={"RULENAME": "sender's"}))
    with ns.get_subscription_receiver("t", "s") as r:
        props = sorted((m.application_properties or {} for m in peek_all(r)), key=lambda p: str(p.get("x")))
    assert props == [{"x": 1, "RuleName": "ruleA"}, {"x": 2, "RuleName": "ruleB"}, {"RULENAME": "sender's"}]


def test_action_setting_session_id_is_refused_where_it_would_strand_the_copy(ns: Namespace) -> None:
    """SET sys.SessionId on a session subscription of a partitioned topic is refused; a REMOVE dead-letters the copy."""
    ns.create_topic("t")
    ns.create_subscription("t", "s", requires_session=True)
    for make in (
        lambda: ns.create_rule("t", "s", "move", action=SqlRuleAction("SET sys.SessionId = 'other'")),
        lambda: ns.update_rule(
            "t", "s", ns.get_rule("t", "s", "$Default"), action=SqlRuleAction("SET x = 1; SET sys.SessionId = 'o'")
        ),
    ):
        with pytest.raises(InvalidOperationError, match="partition"):
            make()
    assert [(r.name, r.action) for r in ns.list_rules("t", "s")] == [("$Default", None)]
    ns.create_subscription("t", "plain")  # no sessions: a copy in any partition is received
    ns.create_rule("t", "plain", "move", action=SqlRuleAction("SET sys.SessionId = 'other'"))

    ns.create_rule("t", "s", "drop", action=SqlRuleAction("REMOVE sys.SessionId"))
    ns.get_topic_sender("t").send_messages(Message("x", message_id="m", session_id="A"))
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        (dead,) = peek_all(r)
    assert (dead.message_id, dead.session_id, dead.dead_letter_reason) == ("m", None, "SessionIdRequired")
    with ns.get_subscription_receiver("t", "s", session_id="A") as r:
        assert [m.message_id for m in r.receive_messages(max_wait_time=1)] == ["m"]


def test_action_setting_session_id_on_an_unpartitioned_topic(ns: Namespace) -> None:
    """With one partition the moved copy is where a session receiver looks: the rule is allowed and the copy received."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "sess", requires_session=True)
    ns.create_rule("t", "sess", "move", action=SqlRuleAction("SET sys.SessionId = 'other'"))
    ns.delete_rule("t", "sess", "$Default")
    ns.get_topic_sender("t").send_messages(Message("x", message_id="m", session_id="A"))
    with ns.get_subscription_receiver("t", "sess", session_id="other") as r:
        (m,) = r.receive_messages(max_wait_time=1)
        assert (m.message_id, m.session_id) == ("m", "other")
        r.complete_message(m)


@pytest.mark.parametrize(
    "sql",
    [
        "SET sys.ScheduledEnqueueTimeUtc = 'soon'",
        "SET sys.ScheduledEnqueueTimeUtc = 12345",
        "SET sys.TimeToLive = 'forever'",
        "SET sys.TimeToLive = TRUE",
    ],
)
def test_an_action_setting_a_system_property_to_a_constant_of_another_type_is_refused(ns: Namespace, sql: str) -> None:
    """A constant the property could not hold is refused when the rule is made (it would be stored as null: a
    scheduled copy would then be delivered at once); nothing is created."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(FilterSyntaxError):
        ns.create_rule("t", "s", "bad", action=SqlRuleAction(sql))
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]


def _set_field(obj: object, field: str, value: object) -> None:
    setattr(obj, field, value)


MUTATIONS = {
    "sql-syntax": ("filter", "sql_expression", "a = = ("),
    "sql-unbound-parameter": ("filter", "sql_expression", "a = @p"),
    "sql-parameters-not-a-dict": ("filter", "parameters", ["p", 1]),
    "sql-parameter-nan": ("filter", "parameters", {"p": float("nan")}),
    "correlation-property-list": ("correlation", "properties", {"k": [1]}),
    "correlation-field-int": ("correlation", "correlation_id", 5),
    "correlation-emptied": ("correlation", "label", None),
    "action-syntax": ("action", "sql_expression", "SET"),
    "action-parameter-object": ("action", "parameters", {"p": object()}),
}


@pytest.mark.parametrize("via", ["update_rule", "create_rule"])
@pytest.mark.parametrize("mutation", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_a_filter_or_action_changed_after_construction_is_checked_when_stored(
    ns: Namespace, via: str, mutation: tuple[str, str, object]
) -> None:
    """create_rule and update_rule check the filter and action as stored (rebuilt from their descriptions): a field
    changed after construction raises as the constructor would, and the rules and the topic keep working."""
    part, field, value = mutation
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_rule("t", "s", "r", filter=SqlRuleFilter("a = 1"), action=SqlRuleAction("SET b = 1"))
    rule = ns.get_rule("t", "s", "r")
    flt = CorrelationRuleFilter(label="x") if part == "correlation" else rule.filter
    _set_field(rule.action if part == "action" else flt, field, value)
    with pytest.raises(InvalidOperationError):
        if via == "update_rule":
            ns.update_rule("t", "s", rule, filter=flt)
        else:
            ns.create_rule("t", "s", "r2", filter=flt, action=rule.action)
    stored = {r.name: (r.filter, r.action) for r in ns.list_rules("t", "s")}
    assert stored == {"$Default": (TrueRuleFilter(), None), "r": (SqlRuleFilter("a = 1"), SqlRuleAction("SET b = 1"))}
    ns.get_topic_sender("t").send_messages(Message("x", message_id="after", application_properties={"a": 1}))
    assert ids_in(ns, "t", "s") == Counter({"after": 2})


def test_the_stored_rule_is_the_one_returned(ns: Namespace) -> None:
    """create_rule returns the rule as stored: later changes to the objects given change neither."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    flt = SqlRuleFilter("a = 1")
    created = ns.create_rule("t", "s", "r", filter=flt)
    flt.sql_expression = "a = = ("
    assert created.filter == ns.get_rule("t", "s", "r").filter == SqlRuleFilter("a = 1")


@pytest.mark.parametrize("sql", ["SET sys.MessageId = NULL", "REMOVE sys.MessageId", "SET sys.MessageId = user.missing"])
def test_an_action_leaving_no_message_id_dead_letters_the_copy(ns: Namespace, sql: str) -> None:
    """A copy whose action left sys.MessageId null is dead-lettered unmodified (RuleActionViolation); the send succeeds."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.create_subscription("t", "other")
    ns.create_rule("t", "s", "drop-id", action=SqlRuleAction(sql))
    ns.get_topic_sender("t").send_messages(Message("x", message_id="m"))
    assert ids_in(ns, "t", "s") == ids_in(ns, "t", "other") == Counter({"m": 1})  # the $Default copies
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        (dead,) = peek_all(r)
    assert (dead.message_id, dead.dead_letter_reason) == ("m", "RuleActionViolation")
    assert "removed the message id" in (dead.dead_letter_error_description or "")


@pytest.mark.parametrize(
    ("message", "sql"),
    [
        (Message("x", message_id="m", session_id="s1"), "SET sys.PartitionKey = 'other'"),
        (Message("x", message_id="m", partition_key="K"), "SET sys.SessionId = 'X'; SET sys.PartitionKey = 'K'"),
    ],
)
def test_an_action_making_the_partition_key_differ_from_the_session_id_dead_letters_the_copy(
    ns: Namespace, message: Message, sql: str
) -> None:
    """The session id is the partition key (docs/semantics.md §3). A copy an action gave a partition key other than its
    session id was stored as it was: it could not be sent on, and `sparkqueue resubmit` stopped at it with the
    subscription's other dead letters. It goes to the dead letters unmodified (RuleActionViolation), also when the
    action set the key it was sent with (a key the action sets does not follow the session id)."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "s", requires_session=True)
    ns.delete_rule("t", "s", "$Default")
    ns.create_rule("t", "s", "keys", action=SqlRuleAction(sql))
    ns.get_topic_sender("t").send_messages(message)
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        dead = [m for m in peek_all(r) if m.dead_letter_reason == "RuleActionViolation"]
    assert [(m.message_id, m.session_id, m.partition_key) for m in dead] == [("m", message.session_id, message.partition_key)]
    assert "differ from session_id" in (dead[0].dead_letter_error_description or "")


@pytest.mark.parametrize("message", [Message("x", session_id="a"), Message("x", session_id="a", partition_key="a")])
def test_an_action_setting_the_session_id_takes_the_partition_key_along(ns: Namespace, message: Message) -> None:
    """`SET sys.SessionId = 'b'` on a message sent with session "a" and partition key "a" (the SDK allows both, equal)
    dead-lettered the copy for a key differing from its session: the key is the session id, so it follows it."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "s", requires_session=True)
    ns.create_rule("t", "s", "move", action=SqlRuleAction("SET sys.SessionId = 'b'"))
    ns.get_topic_sender("t").send_messages(message)
    with ns.get_subscription_receiver("t", "s", session_id="b", max_wait_time=2) as r:
        (got,) = r.receive_messages(max_message_count=5, max_wait_time=2)
        assert (got.session_id, got.partition_key) == ("b", None if message.partition_key is None else "b")
        r.complete_message(got)


LONE = "\udc80"  # a lone surrogate: a Python str with no UTF-8 form


@pytest.mark.parametrize(
    ("flt", "action"),
    [
        (CorrelationRuleFilter(label=LONE), None),
        (CorrelationRuleFilter(properties={"k": LONE}), None),
        (CorrelationRuleFilter(properties={LONE: "v"}), None),
        (SqlRuleFilter(f"sys.Label = '{LONE}'"), None),
        (SqlRuleFilter("sys.Label = @p", parameters={"@p": LONE}), None),
        (None, SqlRuleAction(f"SET x = '{LONE}'")),
        (None, SqlRuleAction(f"SET [{LONE}] = 1")),
        (None, SqlRuleAction("SET x = @p", parameters={"@p": LONE})),
    ],
)
def test_a_rule_with_a_string_that_has_no_utf8_form_is_refused_and_sends_go_on(ns: Namespace, flt: Any, action: Any) -> None:
    """Fan-out builds Arrow strings from a rule's text: stored, such a rule broke every send to the topic."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError, match="no UTF-8 form"):
        ns.create_rule("t", "s", "bad", filter=flt, action=action)
    rule = ns.get_rule("t", "s", "$Default")
    with pytest.raises(InvalidOperationError, match="no UTF-8 form"):
        ns.update_rule("t", "s", rule, filter=flt or TrueRuleFilter(), action=action)
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x", subject="orders"))
    assert ns.get_subscription_runtime_properties("t", "s").active_message_count == 1


def test_a_rule_that_fails_on_a_message_dead_letters_it_in_that_subscription_and_the_topic_goes_on(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Service Bus with dead_lettering_on_filter_evaluation_exceptions: that subscription's dead-letter queue gets it.

    Before, a rule that raised (an action's time past year 9999 did) stopped the whole send: no
    subscription got a copy. Without the setting the subscription gets no copy of that message.
    """
    from sparkqueue.model import filters

    ns.create_topic("t")
    for name, flag in (("loud", True), ("quiet", False)):
        ns.create_subscription("t", name, dead_lettering_on_filter_evaluation_exceptions=flag)
        ns.delete_rule("t", name, "$Default")
        ns.create_rule("t", name, "fragile", filter=SqlRuleFilter("kind = 'fragile'"))
    ns.create_subscription("t", "all")
    real = filters.SqlRuleFilter.evaluate

    def failing_on_poison(self: Any, batch: Any) -> Any:  # a rule whose evaluation raises on one message
        if self.sql_expression == "kind = 'fragile'" and "poison" in batch.column("message_id").to_pylist():
            raise ArithmeticError("this message breaks the rule")
        return real(self, batch)

    monkeypatch.setattr(filters.SqlRuleFilter, "evaluate", failing_on_poison)
    with ns.get_topic_sender("t") as s:
        s.send_messages(
            [
                Message("x", message_id="poison", application_properties={"kind": "fragile"}),
                Message("x", message_id="fine", application_properties={"kind": "fragile"}),
                Message("x", message_id="other", application_properties={"kind": "sturdy"}),
            ]
        )
    monkeypatch.undo()
    assert ids_in(ns, "t", "all") == Counter({"poison": 1, "fine": 1, "other": 1})
    assert ids_in(ns, "t", "loud") == ids_in(ns, "t", "quiet") == Counter({"fine": 1})
    with ns.get_subscription_receiver("t", "loud", sub_queue=SubQueue.DEAD_LETTER) as r:
        (dead,) = peek_all(r)
    assert (dead.message_id, dead.dead_letter_reason) == ("poison", "FilterEvaluationException")
    assert "this message breaks the rule" in (dead.dead_letter_error_description or "")
    with ns.get_subscription_receiver("t", "quiet", sub_queue=SubQueue.DEAD_LETTER) as r:
        assert peek_all(r) == []


def test_an_action_setting_a_time_past_the_latest_storable_one_stores_the_latest(ns: Namespace) -> None:
    """datetime.max set by an action broke every send to the topic (a raw OverflowError); a send stores it as the latest time."""
    ns.create_topic("t")
    ns.create_subscription("t", "later")
    ns.create_subscription("t", "all")
    ns.delete_rule("t", "later", "$Default")
    never = datetime.max.replace(tzinfo=UTC)
    ns.create_rule("t", "later", "r", action=SqlRuleAction("SET sys.ScheduledEnqueueTimeUtc = @t", parameters={"@t": never}))
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x", message_id="m"))
    assert ids_in(ns, "t", "all") == Counter({"m": 1})
    assert ns.get_subscription_runtime_properties("t", "later").scheduled_message_count == 1


@pytest.mark.parametrize(
    ("flt", "action"),
    [(SqlRuleFilter("sys.SequenceNumber % 2 = 0"), None), (None, SqlRuleAction("SET seq = sys.SequenceNumber"))],
)
def test_a_rule_reading_the_sequence_number_is_refused(ns: Namespace, flt: Any, action: Any) -> None:
    """Copies are numbered when each subscription stores them, after the rules: a rule always read 0."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(FilterSyntaxError, match="SequenceNumber"):
        ns.create_rule("t", "s", "r", filter=flt or TrueRuleFilter(), action=action)


def test_a_rule_can_read_the_expiry_time(ns: Namespace) -> None:
    """A message without a time to live expires at DateTime.MaxValue, as in Service Bus: later than any other."""
    ns.create_topic("t")
    ns.create_subscription("t", "expiring")
    ns.delete_rule("t", "expiring", "$Default")
    ns.create_rule("t", "expiring", "r", filter=SqlRuleFilter("sys.ExpiresAtUtc < sys.EnqueuedTimeUtc + 7200000"))
    ns.create_subscription("t", "after")
    ns.delete_rule("t", "after", "$Default")
    ns.create_rule("t", "after", "r", filter=SqlRuleFilter("sys.ExpiresAtUtc > sys.EnqueuedTimeUtc"))
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("x", message_id="ttl", time_to_live=timedelta(hours=1)), Message("y", message_id="never")])
    assert ids_in(ns, "t", "expiring") == Counter({"ttl": 1})
    assert ids_in(ns, "t", "after") == Counter({"ttl": 1, "never": 1})


def test_the_docs_lifetime_filter_selects_a_message_without_time_to_live(ns: Namespace) -> None:
    """`sys.ExpiresAtUtc - sys.EnqueuedTimeUtc > @d` (docs/semantics.md §8) raised for a message without a TTL (its
    expiry, DateTime.MaxValue, lies over 2**53 µs after its enqueue time): fan-out dead-lettered it as
    FilterEvaluationException. It lives forever, so the filter selects it."""
    ns.create_topic("t")
    subscribe(
        ns, "t", "s", {"long": (SqlRuleFilter("sys.ExpiresAtUtc - sys.EnqueuedTimeUtc > @d", {"d": timedelta(minutes=1)}), None)}
    )
    with ns.get_topic_sender("t") as s:
        s.send_messages(
            [
                Message("forever"),
                Message("hour", time_to_live=timedelta(hours=1)),
                Message("second", time_to_live=timedelta(seconds=30)),
            ]
        )
    with ns.get_subscription_receiver("t", "s") as r:
        assert sorted(str(m) for m in peek_all(r)) == ["forever", "hour"]
    assert ns.get_subscription_runtime_properties("t", "s").dead_letter_message_count == 0


def test_an_action_copy_counts_its_properties_as_a_send_does(ns: Namespace) -> None:
    """The properties an action rewrites are stored as a send stores them (UTF-8, not escaped), so the copy's size is a send's."""
    ns.create_topic("t")
    subscribe(ns, "t", "s", {"act": (TrueRuleFilter(), SqlRuleAction("SET x = 1"))})
    ns.create_queue("q")
    props = {"name": "café ☕", "x": 1, "RuleName": "act"}
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("body", message_id="m", application_properties=props))
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("body", message_id="m", application_properties={"name": "café ☕"}))
    with ns.get_queue_receiver("q") as r:
        (sent,) = peek_all(r)
    with ns.get_subscription_receiver("t", "s") as r:
        (copy,) = peek_all(r)
    assert copy.application_properties == props
    assert copy.size_in_bytes == sent.size_in_bytes


def test_a_message_without_time_to_live_is_filtered_as_living_forever(ns: Namespace) -> None:
    """Service Bus: an unset TimeToLive is the entity's default (TimeSpan.MaxValue) and ExpiresAtUtc follows; not NULL."""
    ns.create_topic("t")
    now = datetime.now(UTC)
    subscribe(
        ns, "t", "s", {"forever": (SqlRuleFilter("sys.TimeToLive IS NOT NULL AND sys.ExpiresAtUtc > @now", {"now": now}), None)}
    )
    subscribe(ns, "t", "short", {"short": (SqlRuleFilter("sys.TimeToLive < 3600000"), None)})
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("forever"), Message("minute", time_to_live=timedelta(minutes=1))])
    with ns.get_subscription_receiver("t", "s") as r:
        assert sorted(str(m) for m in peek_all(r)) == ["forever", "minute"]
    with ns.get_subscription_receiver("t", "short") as r:
        assert [str(m) for m in peek_all(r)] == ["minute"]


def test_a_rule_stored_before_a_check_of_new_rules_keeps_working(ns: Namespace) -> None:
    """A rule the catalog holds is parsed without the kind checks new rules get: an old rule that no longer passes
    them keeps its old meaning (NULL arithmetic; a SET it cannot hold dead-letters that copy) instead of failing
    every send to the topic."""
    ns.create_topic("t")
    subscribe(ns, "t", "plain", {"all": (TrueRuleFilter(), None)})
    ns.create_subscription("t", "old")
    ns.delete_rule("t", "old", "$Default")
    with stored_rules():  # as an earlier version stored them
        ns.create_rule("t", "old", "neg", filter=SqlRuleFilter("sys.Label = 'a' OR -sys.EnqueuedTimeUtc < 0"))
        ns.create_rule(
            "t", "old", "ttl", filter=SqlRuleFilter("sys.Label = 'b'"), action=SqlRuleAction("SET sys.TimeToLive = sys.Label")
        )
    with pytest.raises(FilterSyntaxError):
        SqlRuleFilter("-sys.EnqueuedTimeUtc < 0")  # a new rule gets the check
    assert sorted(r.name for r in ns.list_rules("t", "old")) == ["neg", "ttl"]
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("a", subject="a"), Message("b", subject="b"), Message("c", subject="c")])
    with ns.get_subscription_receiver("t", "plain") as r:
        assert sorted(str(m) for m in peek_all(r)) == ["a", "b", "c"]
    with ns.get_subscription_receiver("t", "old") as r:
        assert [str(m) for m in peek_all(r)] == ["a"]
    with ns.get_subscription_receiver("t", "old", sub_queue=SubQueue.DEAD_LETTER) as r:
        assert [(str(m), m.dead_letter_reason) for m in peek_all(r)] == [("b", "FilterEvaluationException")]


def test_a_string_joined_with_a_number_is_a_string_for_set_checks() -> None:
    """`sys.Label + 1` evaluates to a string ("a1"), so SET sys.TimeToLive to it is refused when the rule is made."""
    with pytest.raises(FilterSyntaxError, match="not a string expression"):
        SqlRuleAction("SET sys.TimeToLive = sys.Label + 1")
    SqlRuleAction("SET sys.Label = sys.Label + 1")  # a string property takes it


@pytest.mark.parametrize("dead_letter_on_errors", [True, False])
def test_an_action_joining_a_string_past_the_message_size_dead_letters_the_copy_as_it_joins(
    ns: Namespace, dead_letter_on_errors: bool
) -> None:
    """An accepted action of a few hundred characters doubling a string built gigabytes per send before the size check.

    The join that passes the tier's message size stops the action at once; the copy goes to the
    dead letters as any copy an action leaves too large (RuleActionViolation), whatever the
    filter-exception setting says.
    """
    ns.create_topic("t")
    ns.create_subscription("t", "s", dead_lettering_on_filter_evaluation_exceptions=dead_letter_on_errors)
    ns.create_subscription("t", "all")
    ns.delete_rule("t", "s", "$Default")
    doubling = "; ".join(["SET user.a = user.a + user.a"] * 20)
    ns.create_rule("t", "s", "grow", action=SqlRuleAction(f"SET user.a = '{'x' * 250}'; {doubling}"))
    with ns.get_topic_sender("t") as s:
        s.send_messages([Message("x", message_id=f"m{i}") for i in range(3)])
    assert ids_in(ns, "t", "all") == Counter({"m0": 1, "m1": 1, "m2": 1})
    assert ids_in(ns, "t", "s") == Counter()
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        dead = peek_all(r)
    assert sorted(m.message_id for m in dead) == ["m0", "m1", "m2"]
    assert {m.dead_letter_reason for m in dead} == {"RuleActionViolation"}
    assert all("joined a string of 512000 bytes" in (m.dead_letter_error_description or "") for m in dead)
    assert all("a" not in (m.application_properties or {}) for m in dead)  # the copy as sent, not as the action left it


@pytest.mark.parametrize(
    ("sql", "queue", "shown"),
    [("SET sys.TimeToLive = 1e300", "main", None), ("SET sys.TimeToLive = -1e300", "dead", "-9223372036854775808")],
)
def test_an_action_setting_a_time_to_live_past_int64_holds_it_at_the_end_of_the_range(
    ns: Namespace, sql: str, queue: str, shown: str | None
) -> None:
    """A float past int64 wrapped in the cast: 1e300 ms read as a negative time to live, and its copy was dead-lettered."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.delete_rule("t", "s", "$Default")
    ns.create_rule("t", "s", "ttl", action=SqlRuleAction(sql))
    with ns.get_topic_sender("t") as s:
        s.send_messages(Message("x", message_id="m"))
    with ns.get_subscription_receiver("t", "s") as r:
        main = peek_all(r)
    with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
        dead = peek_all(r)
    if queue == "main":
        assert ([m.message_id for m in main], dead) == (["m"], [])
        assert main[0].expires_at_utc is None or main[0].expires_at_utc.year == 9999  # never expires
    else:
        assert (main, [m.message_id for m in dead]) == ([], ["m"])
        assert f"sys.TimeToLive to {shown} ms" in (dead[0].dead_letter_error_description or "")


@pytest.mark.parametrize(
    ("flt", "action"),
    [
        (CorrelationRuleFilter(correlation_id="c" * 1025), None),
        (CorrelationRuleFilter(properties={"k": "v" * 1025}), None),
        (CorrelationRuleFilter(properties={"k" * 1025: "v"}), None),
        (SqlRuleFilter("sys.Label = @p", parameters={"@p": "v" * 1025}), None),
        (None, SqlRuleAction("SET x = @p", parameters={"@p": "v" * 1025})),
        (CorrelationRuleFilter(properties={f"k{i}": "v" * 1000 for i in range(70)}), None),  # each fits, not together
    ],
)
def test_a_rule_with_an_oversized_value_is_refused_and_changes_nothing(ns: Namespace, flt: Any, action: Any) -> None:
    """Rule values had no bound: a 100 MB value was copied into every send and slowed every catalog change of the namespace."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    with pytest.raises(InvalidOperationError, match=r"at most (1024|65536)"):
        ns.create_rule("t", "s", "big", filter=flt, action=action)
    rule = ns.get_rule("t", "s", "$Default")
    with pytest.raises(InvalidOperationError, match=r"at most (1024|65536)"):
        ns.update_rule("t", "s", rule, filter=flt or TrueRuleFilter(), action=action)
    assert [r.name for r in ns.list_rules("t", "s")] == ["$Default"]
    assert isinstance(ns.get_rule("t", "s", "$Default").filter, TrueRuleFilter | SqlRuleFilter)
    assert ns.get_rule("t", "s", "$Default").filter.sql_expression == "1=1"


def test_a_rule_with_values_at_the_bound_is_stored(ns: Namespace) -> None:
    """1,024 characters, as a SQL literal may be, is accepted and matches."""
    ns.create_topic("t")
    ns.create_subscription("t", "s")
    ns.delete_rule("t", "s", "$Default")
    value = "v" * 1024
    ns.create_rule("t", "s", "edge", filter=CorrelationRuleFilter(properties={"k" * 1024: value}))
    with ns.get_topic_sender("t") as s:
        s.send_messages(
            [Message("x", message_id="hit", application_properties={"k" * 1024: value}), Message("y", message_id="miss")]
        )
    assert ids_in(ns, "t", "s") == Counter({"hit": 1})


def test_a_topic_holds_at_most_its_quota_of_subscriptions_and_filters(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Service Bus's per-topic quotas (2,000 subscriptions, 2,000 SQL and 100,000 correlation filters), here made small.

    Each subscription's $Default rule is a SQL filter. A create past a quota raises QuotaExceededError and stores nothing.
    """
    from sparkqueue.errors import QuotaExceededError
    from sparkqueue.model import limits

    monkeypatch.setattr(limits, "MAX_SUBSCRIPTIONS_PER_TOPIC", 3)
    monkeypatch.setattr(limits, "MAX_SQL_FILTERS_PER_TOPIC", 4)
    monkeypatch.setattr(limits, "MAX_CORRELATION_FILTERS_PER_TOPIC", 1)
    ns.create_topic("t")
    ns.create_topic("other")
    for name in ("a", "b", "c"):
        ns.create_subscription("t", name)
    with pytest.raises(QuotaExceededError, match="3 subscriptions"):
        ns.create_subscription("T", "d")
    ns.create_subscription("other", "d")  # another topic's quota
    ns.create_rule("t", "a", "sql", filter=SqlRuleFilter("color = 'red'"))  # the 4th SQL filter
    with pytest.raises(QuotaExceededError, match="4 rules with a SQL"):
        ns.create_rule("t", "b", "more", filter=FalseRuleFilter())
    ns.create_rule("t", "b", "corr", filter=CorrelationRuleFilter(label="orders"))
    with pytest.raises(QuotaExceededError, match="1 rules with a correlation"):
        ns.create_rule("t", "c", "corr", filter=CorrelationRuleFilter(label="invoices"))
    assert [s.name for s in ns.list_subscriptions("t")] == ["a", "b", "c"]
    assert sorted(r.name for r in ns.list_rules("t", "b")) == ["$Default", "corr"]
    assert [r.name for r in ns.list_rules("t", "c")] == ["$Default"]
    ns.delete_rule("t", "a", "sql")
    ns.create_rule("t", "b", "more", filter=FalseRuleFilter())  # room again
