"""Tests of the Service Bus SQL filter language, correlation/true/false filters and SQL rule actions."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pyarrow as pa
import pytest

from sparkqueue.errors import FilterSyntaxError, InvalidOperationError
from sparkqueue.model.filters import (
    CorrelationRuleFilter,
    FalseRuleFilter,
    SqlRuleAction,
    SqlRuleFilter,
    TrueRuleFilter,
    action_from_dict,
    filter_from_dict,
)

TIME = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        pa.field("message_id", pa.string()),
        pa.field("correlation_id", pa.string()),
        pa.field("subject", pa.string()),
        pa.field("to", pa.string()),
        pa.field("reply_to", pa.string()),
        pa.field("reply_to_session_id", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("content_type", pa.string()),
        pa.field("partition_key", pa.string()),
        pa.field("sequence_number", pa.int64()),
        pa.field("enqueued_time_utc", TIME),
        pa.field("scheduled_enqueue_time_utc", TIME),
        pa.field("delivery_count", pa.int32()),
        pa.field("size_in_bytes", pa.int32()),
        pa.field("time_to_live_ms", pa.int64()),
        pa.field("application_properties", pa.string()),
    ]
)
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def make_batch(*rows: dict[str, Any], columns: list[str] | None = None) -> pa.Table:
    """One row per message: system columns by name, application properties as ``props`` (a dict, JSON-encoded)."""
    fields = [f for f in SCHEMA if columns is None or f.name in columns]
    data: dict[str, list[Any]] = {}
    for f in fields:
        if f.name == "application_properties":
            data[f.name] = [json.dumps(row["props"]) if "props" in row else None for row in rows]
        else:
            data[f.name] = [row.get(f.name) for row in rows]
    return pa.table(data, schema=pa.schema(fields))


def props_of(table: pa.Table) -> list[dict[str, Any] | None]:
    """Decoded application properties per row."""
    return [None if text is None else json.loads(text) for text in table.column("application_properties").to_pylist()]


def run(expression: str, table: pa.Table, parameters: dict[str, Any] | None = None) -> list[bool]:
    """Evaluate a SQL filter and return the match per row."""
    result = SqlRuleFilter(expression, parameters).evaluate(table)
    assert result.type == pa.bool_() and result.null_count == 0
    return result.to_pylist()


# Rows: a typical message, string/number lookalikes, JSON null, no properties, null property column.
PROPS = make_batch(
    {"props": {"color": "red", "qty": 5, "price": 2.5, "flag": True, "name": "O'Brien"}},
    {"props": {"color": "Red", "qty": "5", "price": 10, "flag": False}},
    {"props": {"color": "blue", "qty": 7, "price": None}},
    {"props": {}},
    {},
)
T, F = True, False

SYS = make_batch(
    {
        "message_id": "m1",
        "correlation_id": "c1",
        "subject": "l1",
        "to": "to1",
        "reply_to": "r1",
        "reply_to_session_id": "rs1",
        "session_id": "s1",
        "content_type": "application/json",
        "partition_key": "pk1",
        "sequence_number": 1,
        "enqueued_time_utc": T0,
        "scheduled_enqueue_time_utc": None,
        "delivery_count": 1,
        "size_in_bytes": 50,
        "time_to_live_ms": 60000,
        "props": {"color": "red"},
    },
    {
        "message_id": "m2",
        "correlation_id": "c2",
        "subject": "L1",
        "to": None,
        "reply_to": "r2",
        "reply_to_session_id": "rs2",
        "session_id": "s2",
        "content_type": "text/plain",
        "partition_key": "pk2",
        "sequence_number": 2,
        "enqueued_time_utc": T0 + dt.timedelta(hours=1),
        "scheduled_enqueue_time_utc": T0 + dt.timedelta(days=1),
        "delivery_count": 3,
        "size_in_bytes": 500,
        "time_to_live_ms": None,
        "props": {"color": "blue"},
    },
)


# --------------------------------------------------------------------------- comparisons


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("qty = 5", [T, F, F, F, F]),
        ("qty <> 5", [F, T, T, F, F]),  # "5" is a string: unlike types are not equal
        ("qty != 5", [F, T, T, F, F]),
        ("qty > 5", [F, F, T, F, F]),
        ("qty >= 5", [T, F, T, F, F]),
        ("qty < 7", [T, F, F, F, F]),
        ("qty <= 7", [T, F, T, F, F]),
        ("5 = qty", [T, F, F, F, F]),
        ("color = 'red'", [T, F, F, F, F]),
        ("color <> 'red'", [F, T, T, F, F]),
        ("color > 'blue'", [T, F, F, F, F]),
        ("color < 'blue'", [F, T, F, F, F]),
        ("price = 10", [F, T, F, F, F]),
        ("price = 10.0", [F, T, F, F, F]),
        ("price < 3", [T, F, F, F, F]),
        ("qty > price", [T, F, F, F, F]),
        ("flag = TRUE", [T, F, F, F, F]),
        ("flag <> true", [F, T, F, F, F]),
        ("flag > FALSE", [F, F, F, F, F]),
        ("flag", [T, F, F, F, F]),
        ("name = 'O''Brien'", [T, F, F, F, F]),
    ],
)
def test_comparison_operators(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("qty = '5'", [F, T, F, F, F]),
        ("qty = 5", [T, F, F, F, F]),
        ("qty <> '5'", [T, F, T, F, F]),  # <> is NOT =, as NOT IN is
        ("color = 1", [F, F, F, F, F]),
        ("flag = 1", [F, F, F, F, F]),
    ],
)
def test_unlike_types_are_not_equal(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


def test_mixed_types_per_row() -> None:
    table = make_batch(
        {"props": {"qty": 5}},
        {"props": {"qty": "5"}},
        {"props": {"qty": 5.0}},
        {"props": {"qty": True}},
        {"props": {"qty": None}},
        {"props": {}},
        {"props": {"qty": [5]}},
        {"props": {"qty": {"n": 5}}},
        {"props": {"qty": 2**70}},
    )
    assert run("qty = 5", table) == [T, F, T, F, F, F, F, F, F]
    assert run("qty = '5'", table) == [F, T, F, F, F, F, F, F, F]
    assert run("qty = TRUE", table) == [F, F, F, T, F, F, F, F, F]
    assert run("qty > 4", table) == [T, F, T, F, F, F, F, F, T]
    assert run("qty > 1e20", table) == [F, F, F, F, F, F, F, F, T]
    assert run("qty IN (5, '5')", table) == [T, T, T, F, F, F, F, F, F]
    assert run("qty LIKE '5'", table) == [F, T, F, F, F, F, F, F, F]
    assert run("EXISTS(qty)", table) == [T, T, T, T, T, F, T, T, T]
    assert run("qty IS NULL", table) == [F, F, F, F, T, T, T, T, F]


def test_large_integers_compare_exactly() -> None:
    table = make_batch({"sequence_number": 2**62 + 1}, {"sequence_number": 2**62})
    assert run("sys.SequenceNumber = 4611686018427387905", table) == [T, F]
    assert run("sys.SequenceNumber > 4611686018427387904", table) == [T, F]


# --------------------------------------------------------------------------- logic and null semantics


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("color = 'red' AND qty = 5", [T, F, F, F, F]),
        ("color = 'red' OR qty = 7", [T, F, T, F, F]),
        ("NOT color = 'red'", [F, T, T, F, F]),
        ("NOT (color = 'red')", [F, T, T, F, F]),
        ("NOT NOT color = 'red'", [T, F, F, F, F]),
        ("missing = 1", [F, F, F, F, F]),
        ("NOT (missing = 1)", [F, F, F, F, F]),
        ("missing = 1 OR qty = 7", [F, F, T, F, F]),
        ("missing = 1 AND qty = 7", [F, F, F, F, F]),
        ("NOT (missing = 1 AND qty = 99)", [T, T, T, F, F]),
        ("missing = 1 OR NOT missing = 1", [F, F, F, F, F]),
        ("color = 'red' and QTY = 5 Or color = 'blue'", [T, F, T, F, F]),
    ],
)
def test_logic_is_three_valued(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("TRUE OR FALSE AND FALSE", T),
        ("(TRUE OR FALSE) AND FALSE", F),
        ("NOT FALSE AND FALSE", F),
        ("NOT (FALSE AND FALSE)", T),
        ("NOT 1 = 2", T),
        ("1 + 2 * 3 = 7", T),
        ("(1 + 2) * 3 = 9", T),
        ("10 - 4 - 3 = 3", T),
        ("8 / 2 / 2 = 2", T),
        ("2 * 3 % 4 = 2", T),
        ("-2 * -3 = 6", T),
        ("- (2 + 3) = -5", T),
        ("1 + 1 = 2 AND 2 * 2 = 4", T),
    ],
)
def test_precedence(expression: str, expected: bool) -> None:
    assert run(expression, make_batch({})) == [expected]


# --------------------------------------------------------------------------- arithmetic and literals


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("qty + 1 = 6", [T, F, F, F, F]),
        ("qty - 1 = 6", [F, F, T, F, F]),
        ("qty * 2 = 14", [F, F, T, F, F]),
        ("qty / 2 = 2", [T, F, F, F, F]),
        ("qty % 2 = 1", [T, F, T, F, F]),
        ("price * 2 = 5", [T, F, F, F, F]),
        ("qty - price = 2.5", [T, F, F, F, F]),
        ("-qty = -5", [T, F, F, F, F]),
        ("+qty = 5", [T, F, F, F, F]),
        ("color + '!' = 'red!'", [T, F, F, F, F]),
        ("qty + 'x' IS NULL", [F, F, F, T, T]),  # a number joins a string as text (C#)
        ("qty + 'x' = '5x'", [T, T, F, F, F]),
    ],
)
def test_arithmetic_on_properties(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "7 / 2 = 3",
        "-7 / 2 = -3",
        "7.0 / 2 = 3.5",
        "7 / 2.0 = 3.5",
        "-7 % 3 = -1",
        "7 % -3 = 1",
        "7.5 % 2 = 1.5",
        "1.0 / 0 > 1e300",
        "9223372036854775807 + 1 = -9223372036854775808",
        "2e2 = 200",
        "1.5E-1 = 0.15",
        "0.5e+1 = 5",
        ".5 = 0.5",
        "5. = 5.0",
        "-.25 * 4 = -1",
        "5.e1 = 50",
        "1894.1204 > 1894",
        "-9223372036854775808 < 0",
        "'' = ''",
        "'it''s' = 'it' + '''s'",
        "'a' < 'b'",
        "'B' < 'a'",
        "TRUE",
        "true = TRUE",
        "NULL IS NULL",
        "NOT (NULL IS NOT NULL)",
    ],
)
def test_true_constant_expressions(expression: str) -> None:
    assert run(expression, make_batch({}, {})) == [T, T]


def test_integer_division_by_zero_is_null_and_a_guarded_division_works() -> None:
    """Unknown, not an error: a whole-batch evaluation divides every row, also those a guard (AND/OR) leaves out."""
    assert run("qty / 0 IS NULL AND qty % 0 IS NULL AND missing / 0 IS NULL", PROPS) == [T] * 5
    assert run("1 / 0 IS NULL AND 1 % 0 IS NULL", PROPS) == [T] * 5
    assert run("qty / 0.0 > 1000", PROPS) == [T, F, T, F, F]  # doubles: +infinity, as in C#
    guarded = make_batch({"props": {"a": 10, "b": 0}}, {"props": {"a": 10, "b": 2}})
    assert run("b <> 0 AND a / b > 2", guarded) == [F, T]
    assert run("b = 0 OR a / b > 2", guarded) == [T, T]


@pytest.mark.parametrize("expression", ["FALSE", "NULL", "NULL = NULL", "NULL <> 1", "1 = 1.5", "'a' = 'A'", "'1' = 1"])
def test_false_constant_expressions(expression: str) -> None:
    assert run(expression, make_batch({}, {})) == [F, F]


# --------------------------------------------------------------------------- IN, LIKE, IS NULL, EXISTS


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("color IN ('red', 'blue')", [T, F, T, F, F]),
        ("color NOT IN ('red', 'blue')", [F, T, F, F, F]),
        ("color in ('red')", [T, F, F, F, F]),
        ("qty IN (5, 6)", [T, F, F, F, F]),
        ("qty IN (5.0)", [T, F, F, F, F]),
        ("qty IN ('5')", [F, T, F, F, F]),
        ("qty NOT IN (5)", [F, T, T, F, F]),
        ("price IN (10.0, 2.5)", [T, T, F, F, F]),
        ("flag IN (TRUE)", [T, F, F, F, F]),
        ("missing IN (1, 2)", [F, F, F, F, F]),
        ("missing NOT IN (1, 2)", [F, F, F, F, F]),
        ("qty IN (NULL, 5)", [T, F, F, F, F]),
        ("qty NOT IN (NULL, 5)", [F, T, T, F, F]),
        ("qty IN (price * 2, 100)", [T, F, F, F, F]),
        ("qty IN (price * 2, 7)", [T, F, T, F, F]),
        ("qty + 1 IN (6, 8)", [T, F, T, F, F]),
    ],
)
def test_in_lists(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


STRINGS = make_batch(
    *[{"props": {"s": s}} for s in ["abc", "a%c", "a_c", "xabcx", "ABC", None, "a\\c", "aXc", "ac"]],
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("s LIKE 'a%'", [T, T, T, F, F, F, T, T, T]),
        ("s LIKE 'a_c'", [T, T, T, F, F, F, T, T, F]),
        ("s LIKE '%b%'", [T, F, F, T, F, F, F, F, F]),
        ("s LIKE 'abc'", [T, F, F, F, F, F, F, F, F]),
        ("s LIKE '%'", [T, T, T, T, T, F, T, T, T]),
        ("s NOT LIKE 'a%'", [F, F, F, T, T, F, F, F, F]),
        ("s LIKE 'a!%c' ESCAPE '!'", [F, T, F, F, F, F, F, F, F]),
        ("s LIKE 'a!_c' ESCAPE '!'", [F, F, T, F, F, F, F, F, F]),
        ("s LIKE 'a!!c' ESCAPE '!'", [F, F, F, F, F, F, F, F, F]),
        ("s like 'a\\%c' escape '\\'", [F, T, F, F, F, F, F, F, F]),
        ("s LIKE 'a\\c'", [F, F, F, F, F, F, T, F, F]),
        ("s LIKE 'a%%c' ESCAPE '%'", [F, T, F, F, F, F, F, F, F]),
        ("s NOT LIKE 'a!%c' ESCAPE '!'", [T, F, T, T, T, F, T, T, T]),
    ],
)
def test_like(expression: str, expected: list[bool]) -> None:
    assert run(expression, STRINGS) == expected


def test_like_with_parameters() -> None:
    assert run("s LIKE @p ESCAPE @e", STRINGS, {"@p": "a#_c", "@e": "#"}) == [F, F, T, F, F, F, F, F, F]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("price IS NULL", [F, F, T, T, T]),
        ("price IS NOT NULL", [T, T, F, F, F]),
        ("price is not null", [T, T, F, F, F]),
        ("EXISTS(price)", [T, T, T, F, F]),
        ("exists (user.price)", [T, T, T, F, F]),
        ("NOT EXISTS(price)", [F, F, F, T, T]),
        ("EXISTS(missing)", [F, F, F, F, F]),
        ("EXISTS(qty) AND qty IS NULL", [F, F, F, F, F]),
    ],
)
def test_null_tests_and_exists(expression: str, expected: list[bool]) -> None:
    assert run(expression, PROPS) == expected


# --------------------------------------------------------------------------- properties and names


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("sys.MessageId = 'm1'", [T, F]),
        ("sys.CorrelationId = 'c2'", [F, T]),
        ("sys.To = 'to1'", [T, F]),
        ("sys.To IS NULL", [F, T]),
        ("EXISTS(sys.To)", [T, F]),
        ("sys.ReplyTo = 'r2'", [F, T]),
        ("sys.Label = 'l1'", [T, F]),
        ("sys.Subject = 'L1'", [F, T]),
        ("sys.SessionId = 's1'", [T, F]),
        ("sys.ReplyToSessionId = 'rs2'", [F, T]),
        ("sys.ContentType LIKE 'application/%'", [T, F]),
        ("sys.PartitionKey = 'pk2'", [F, T]),
        ("sys.SequenceNumber = 1", [T, F]),
        ("sys.SequenceNumber * 10 > 15", [F, T]),
        ("sys.DeliveryCount >= 2", [F, T]),
        ("sys.Size < 100", [T, F]),
        ("sys.TimeToLive = 60000", [T, F]),
        ("sys.TimeToLive IS NULL", [F, F]),  # unset: the entity's default, TimeSpan.MaxValue (Service Bus)
        ("sys.TimeToLive > 86400000 * 365", [F, T]),
        ("sys.ScheduledEnqueueTimeUtc IS NULL", [T, F]),
        ("sys.EnqueuedTimeUtc = sys.EnqueuedTimeUtc", [T, T]),
        ("sys.EnqueuedTimeUtc < sys.ScheduledEnqueueTimeUtc", [F, T]),
        ("SYS.label = 'l1'", [T, F]),
        ("Sys.LABEL = 'l1'", [T, F]),
        ("sys.sequencenumber = 2", [F, T]),
        ("sys.reply_to = 'r1'", [T, F]),
        ("sys.[Label] = 'l1'", [T, F]),
        ("sys.Label = user.color", [F, F]),
        ("sys.Label = 'l1' AND color = 'red'", [T, F]),
    ],
)
def test_system_properties(expression: str, expected: list[bool]) -> None:
    assert run(expression, SYS) == expected


def test_time_parameters() -> None:
    assert run("sys.EnqueuedTimeUtc > @t", SYS, {"@t": T0}) == [F, T]
    assert run("sys.EnqueuedTimeUtc >= @t", SYS, {"t": dt.datetime(2024, 1, 1)}) == [T, T]
    paris = dt.timezone(dt.timedelta(hours=1))
    assert run("sys.EnqueuedTimeUtc = @t", SYS, {"@t": dt.datetime(2024, 1, 1, 2, tzinfo=paris)}) == [F, T]
    assert run("sys.EnqueuedTimeUtc IN (@a, @b)", SYS, {"a": T0, "b": T0 - dt.timedelta(1)}) == [T, F]
    assert run("sys.EnqueuedTimeUtc = '2024-01-01'", SYS) == [F, F]


def test_missing_columns_count_as_null() -> None:
    table = make_batch({"subject": "a"}, {"subject": None}, columns=["subject"])
    assert run("sys.To IS NULL", table) == [T, T]
    assert run("sys.To = 'x' OR sys.Label = 'a'", table) == [T, F]
    assert run("NOT sys.To = 'x'", table) == [F, F]
    assert run("color = 'red'", table) == [F, F]
    assert run("color IS NULL AND NOT EXISTS(color)", table) == [T, T]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("user.color = 'red'", [T, F, F, F]),
        ("USER.color = 'red'", [T, F, F, F]),
        ("[my prop] = 1", [F, T, F, F]),
        ("user.[my prop] = 1", [F, T, F, F]),
        ('"my prop" = 1', [F, T, F, F]),
        ("[a]]b] = 2", [F, F, T, F]),
        ("[in] = 3", [F, F, F, T]),
        ("größe = 4", [F, F, F, T]),
        ("_under = 5", [T, F, F, F]),
        ("COLOR = 'red'", [T, F, F, F]),
        ("property('my prop') = 1", [F, T, F, F]),
        ("p('color') = 'red'", [T, F, F, F]),
    ],
)
def test_application_property_names(expression: str, expected: list[bool]) -> None:
    table = make_batch(
        {"props": {"color": "red", "_under": 5}},
        {"props": {"my prop": 1}},
        {"props": {"a]b": 2}},
        {"props": {"in": 3, "größe": 4}},
    )
    assert run(expression, table) == expected


def test_exact_case_property_wins() -> None:
    table = make_batch({"props": {"Color": "x", "color": "y"}}, {"props": {"COLOR": "z"}})
    assert run("Color = 'x'", table) == [T, F]
    assert run("color = 'y'", table) == [T, F]
    assert run("color = 'z'", table) == [F, T]


def test_newid() -> None:
    table = make_batch({}, {})
    assert run("newid() IS NOT NULL", table) == [T, T]
    assert run("newid() = newid()", table) == [F, F]
    assert run("NEWID() LIKE '________-____-____-____-____________'", table) == [T, T]


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("expression", "parameters", "expected"),
    [
        ("color = @c", {"@c": "red"}, [T, F, F, F, F]),
        ("color = @c", {"c": "blue"}, [F, F, T, F, F]),
        ("color = @C", {"@c": "red"}, [T, F, F, F, F]),
        ("qty = @n", {"@n": 5}, [T, F, F, F, F]),
        ("price = @f", {"@f": 2.5}, [T, F, F, F, F]),
        ("flag = @b", {"@b": False}, [F, T, F, F, F]),
        ("color = @missing", {"@missing": None}, [F, F, F, F, F]),
        ("@missing IS NULL", {"@missing": None}, [T, T, T, T, T]),
        ("qty IN (@a, @b)", {"@a": 7, "@b": "5"}, [F, T, T, F, F]),
        ("qty = @a + 1", {"@a": 4}, [T, F, F, F, F]),
    ],
)
def test_parameters(expression: str, parameters: dict[str, Any], expected: list[bool]) -> None:
    assert run(expression, PROPS, parameters) == expected


def test_timedelta_and_uuid_parameters() -> None:
    assert run("sys.TimeToLive = @ttl", SYS, {"@ttl": dt.timedelta(minutes=1)}) == [T, F]
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    table = make_batch({"message_id": str(ident)}, {"message_id": "other"})
    assert run("sys.MessageId = @id", table, {"@id": ident}) == [T, F]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({}, "parameter @p has no value"),
        ({"@p": object()}, "unsupported value type"),
        ({"@p": 2**64}, "outside the 64-bit range"),
        ({"": 1}, "parameter names must be non-empty"),
    ],
)
def test_parameter_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(FilterSyntaxError, match=message):
        SqlRuleFilter("color = @p", parameters)


# --------------------------------------------------------------------------- batch shapes


def test_record_batches_chunked_and_empty_tables() -> None:
    table = make_batch({"props": {"n": 1}}, {"props": {"n": 2}})
    chunked = pa.concat_tables([table, table])
    assert chunked.column("application_properties").num_chunks == 2
    assert run("n = 2", chunked) == [F, T, F, T]
    record_batch = table.to_batches()[0]
    assert SqlRuleFilter("n = 1").evaluate(record_batch).to_pylist() == [T, F]
    assert run("n = 1 OR sys.Label = 'x'", table.slice(0, 0)) == []


def test_malformed_or_empty_property_json_counts_as_no_properties() -> None:
    table = pa.table({"application_properties": ['{"n": 1}', "not json", "", "[1, 2]", None, '{"n": 1}']})
    assert run("n = 1", table) == [T, F, F, F, F, T]
    assert run("EXISTS(n)", table) == [T, F, F, F, F, T]


def test_large_string_and_naive_timestamp_columns() -> None:
    table = pa.table(
        {
            "subject": pa.array(["a", "b"], pa.large_string()),
            "enqueued_time_utc": pa.array([dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 2)], pa.timestamp("ns")),
        }
    )
    assert run("sys.Label = 'b'", table) == [F, T]
    assert run("sys.EnqueuedTimeUtc > @t", table, {"@t": T0}) == [F, T]


def test_evaluation_is_repeatable() -> None:
    rule = SqlRuleFilter("qty >= 5")
    first = rule.evaluate(PROPS).to_pylist()
    assert rule.evaluate(PROPS).to_pylist() == first == [T, F, T, F, F]


# --------------------------------------------------------------------------- correlation, true and false filters


@pytest.mark.parametrize(
    ("keyword", "value", "expected"),
    [
        ("correlation_id", "c1", [T, F]),
        ("message_id", "m2", [F, T]),
        ("to", "to1", [T, F]),
        ("reply_to", "r2", [F, T]),
        ("label", "l1", [T, F]),
        ("label", "L1", [F, T]),
        ("session_id", "s2", [F, T]),
        ("reply_to_session_id", "rs1", [T, F]),
        ("content_type", "text/plain", [F, T]),
        ("content_type", "TEXT/PLAIN", [F, F]),
    ],
)
def test_correlation_filter_fields(keyword: str, value: str, expected: list[bool]) -> None:
    assert CorrelationRuleFilter(**{keyword: value}).evaluate(SYS).to_pylist() == expected


def test_correlation_filter_properties_and_combination() -> None:
    assert CorrelationRuleFilter(properties={"color": "red", "qty": 5}).evaluate(PROPS).to_pylist() == [T, F, F, F, F]
    assert CorrelationRuleFilter(properties={"qty": "5"}).evaluate(PROPS).to_pylist() == [F, T, F, F, F]
    assert CorrelationRuleFilter(properties={"flag": False}).evaluate(PROPS).to_pylist() == [F, T, F, F, F]
    assert CorrelationRuleFilter(label="l1", properties={"color": "red"}).evaluate(SYS).to_pylist() == [T, F]
    assert CorrelationRuleFilter(label="l1", properties={"color": "blue"}).evaluate(SYS).to_pylist() == [F, F]
    assert CorrelationRuleFilter(to="to1", reply_to="r2").evaluate(SYS).to_pylist() == [F, F]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "at least one"),
        ({"properties": {}}, "at least one"),
        ({"label": 5}, "must be a string"),
        ({"properties": {"a": None}}, "non-null value"),
        ({"properties": {"a": object()}}, "unsupported value type"),
    ],
)
def test_correlation_filter_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidOperationError, match=message):
        CorrelationRuleFilter(**kwargs)


_PLUS_5 = dt.timezone(dt.timedelta(hours=5))


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), dt.datetime(1, 1, 1, tzinfo=_PLUS_5)],
    ids=["nan", "inf", "-inf", "datetime-before-year-1-utc"],
)
@pytest.mark.parametrize(
    "make",
    [
        lambda v: CorrelationRuleFilter(properties={"a": v}),
        lambda v: SqlRuleFilter("a = @p", {"p": v}),
        lambda v: SqlRuleAction("SET b = @p", {"p": v}),
    ],
    ids=["correlation-property", "filter-parameter", "action-parameter"],
)
def test_values_json_or_utc_cannot_hold_are_refused(make: Any, value: object) -> None:
    """NaN and infinities (no JSON form) and datetimes outside UTC's range raise InvalidOperationError, a ValueError."""
    with pytest.raises(InvalidOperationError):
        make(value)


@pytest.mark.parametrize("make", [lambda: SqlRuleFilter("a = 1", ["p", 1]), lambda: CorrelationRuleFilter(properties=[("a", 1)])])
def test_parameters_and_properties_must_be_dicts(make: Any) -> None:
    with pytest.raises(InvalidOperationError, match="must be a dict"):
        make()


def test_correlation_filter_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        CorrelationRuleFilter("c1")  # type: ignore[misc]


def test_true_and_false_filters() -> None:
    assert TrueRuleFilter().evaluate(PROPS).to_pylist() == [T] * 5
    assert FalseRuleFilter().evaluate(PROPS).to_pylist() == [F] * 5
    assert TrueRuleFilter().evaluate(PROPS.slice(0, 0)).to_pylist() == []
    assert TrueRuleFilter().sql_expression == "1=1" and FalseRuleFilter().sql_expression == "1=0"
    assert SqlRuleFilter("1=1").evaluate(PROPS).to_pylist() == [T] * 5
    assert SqlRuleFilter("1=0").evaluate(PROPS).to_pylist() == [F] * 5
    assert TrueRuleFilter() == TrueRuleFilter() and TrueRuleFilter() != FalseRuleFilter()
    assert TrueRuleFilter() != SqlRuleFilter("1=1")
    assert repr(TrueRuleFilter()) == "TrueRuleFilter()" and repr(FalseRuleFilter()) == "FalseRuleFilter()"
    assert isinstance(TrueRuleFilter(), SqlRuleFilter)


def test_equality_and_repr() -> None:
    assert SqlRuleFilter("a = 1") == SqlRuleFilter("a = 1")
    assert SqlRuleFilter("a = @p", {"@p": 1}) != SqlRuleFilter("a = @p", {"@p": 2})
    assert repr(SqlRuleFilter("a = 1")) == "SqlRuleFilter(sql_expression='a = 1', parameters=None)"
    assert CorrelationRuleFilter(label="x") == CorrelationRuleFilter(label="x")
    assert "label='x'" in repr(CorrelationRuleFilter(label="x"))
    assert SqlRuleAction("SET a = 1") == SqlRuleAction("SET a = 1")
    assert repr(SqlRuleAction("SET a = 1")) == "SqlRuleAction(sql_expression='SET a = 1', parameters=None)"


# --------------------------------------------------------------------------- JSON descriptions


@pytest.mark.parametrize(
    "rule",
    [
        SqlRuleFilter("sys.Label = 'x' AND qty > 5"),
        SqlRuleFilter(
            "sys.EnqueuedTimeUtc > @t AND sys.TimeToLive > @ttl AND sys.MessageId <> @id AND color IN (@c, @n)",
            {"@t": T0, "@ttl": dt.timedelta(seconds=1.5), "@id": uuid.uuid4(), "@c": "red", "@n": None},
        ),
        TrueRuleFilter(),
        FalseRuleFilter(),
        CorrelationRuleFilter(label="x", reply_to_session_id="y"),
        CorrelationRuleFilter(correlation_id="c", properties={"a": 1, "b": "2", "when": T0, "ok": True}),
    ],
)
def test_filter_round_trip(rule: SqlRuleFilter | CorrelationRuleFilter) -> None:
    stored = json.loads(json.dumps(rule.to_dict()))
    restored = filter_from_dict(stored)
    assert restored == rule and type(restored) is type(rule)
    assert restored.evaluate(SYS).to_pylist() == rule.evaluate(SYS).to_pylist()


def test_filter_dict_shapes() -> None:
    assert TrueRuleFilter().to_dict() == {"type": "TrueRuleFilter"}
    assert CorrelationRuleFilter(label="x").to_dict() == {"type": "CorrelationRuleFilter", "label": "x"}
    assert SqlRuleFilter("a = 1").to_dict() == {"type": "SqlRuleFilter", "sql_expression": "a = 1", "parameters": None}


def test_action_round_trip() -> None:
    action = SqlRuleAction("SET sys.Label = @l; REMOVE color", {"@l": "routed"})
    restored = action_from_dict(json.loads(json.dumps(action.to_dict())))
    assert restored == action
    assert restored.apply(SYS).column("subject").to_pylist() == ["routed", "routed"]


@pytest.mark.parametrize(
    "data",
    [{}, {"type": "Nope"}, {"type": "SqlRuleFilter"}, {"type": "SqlRuleAction", "sql_expression": "SET a = 1"}],
)
def test_filter_from_dict_errors(data: dict[str, Any]) -> None:
    with pytest.raises(InvalidOperationError):
        filter_from_dict(data)


@pytest.mark.parametrize("data", [{}, {"type": "SqlRuleFilter", "sql_expression": "a = 1"}, {"type": "SqlRuleAction"}])
def test_action_from_dict_errors(data: dict[str, Any]) -> None:
    with pytest.raises(InvalidOperationError):
        action_from_dict(data)


# --------------------------------------------------------------------------- rule actions


def test_set_application_properties() -> None:
    result = SqlRuleAction("SET color = 'green'; SET total = qty * price").apply(PROPS)
    assert [row and row.get("color") for row in props_of(result)] == ["green"] * 5
    assert [row.get("total") for row in props_of(result)] == [12.5, None, None, None, None]
    assert props_of(result)[0] == {"color": "green", "qty": 5, "price": 2.5, "flag": True, "name": "O'Brien", "total": 12.5}
    assert props_of(result)[4] == {"color": "green", "total": None}


def test_statements_run_in_order_with_optional_semicolons() -> None:
    table = make_batch({"props": {}}, {})
    for text in ("SET a = 1; SET b = a + 1", "SET a = 1 SET b = a + 1;", "set a = 1;; set b = a + 1 ;"):
        assert props_of(SqlRuleAction(text).apply(table)) == [{"a": 1, "b": 2}, {"a": 1, "b": 2}]


def test_remove_application_property() -> None:
    table = make_batch({"props": {"color": "red", "qty": 5}}, {"props": {"qty": 1}}, {"props": {"color": "x"}}, {})
    result = SqlRuleAction("REMOVE color").apply(table)
    assert props_of(result) == [{"qty": 5}, {"qty": 1}, None, None]
    assert result.column("application_properties")[1] == table.column("application_properties")[1]
    assert SqlRuleAction("REMOVE user.[color]").apply(table).equals(result)


def test_set_null_keeps_the_key_and_case_insensitive_targets() -> None:
    table = make_batch({"props": {"Color": "red"}})
    result = SqlRuleAction("SET color = NULL").apply(table)
    assert props_of(result) == [{"Color": None}]
    assert run("EXISTS(color) AND color IS NULL", result) == [T]
    assert props_of(SqlRuleAction("SET COLOR = 'blue'").apply(table)) == [{"Color": "blue"}]


def test_set_types_written_to_json() -> None:
    table = make_batch({"enqueued_time_utc": T0, "props": {}})
    action = SqlRuleAction("SET i = 1; SET f = 0.5; SET b = TRUE; SET s = 'x'; SET t = sys.EnqueuedTimeUtc; SET c = 1 < 2")
    result = action.apply(table)
    assert props_of(result) == [{"i": 1, "f": 0.5, "b": True, "s": "x", "t": "2024-01-01T00:00:00+00:00", "c": True}]


def test_set_system_properties() -> None:
    action = SqlRuleAction(
        "SET sys.Label = 'routed-' + sys.Label; SET sys.To = sys.ReplyTo; SET sys.reply_to = color; "
        "SET sys.CorrelationId = sys.SequenceNumber; SET sys.TimeToLive = 1.9 * 1000; "
        "SET sys.ScheduledEnqueueTimeUtc = @at; SET sys.SessionId = newid(); REMOVE sys.ContentType; "
        "SET sys.ReplyToSessionId = 'x'; SET sys.PartitionKey = 'p'; SET sys.MessageId = 'id'",
        {"at": T0},
    )
    result = action.apply(SYS)
    assert result.schema == SYS.schema
    assert result.column("subject").to_pylist() == ["routed-l1", "routed-L1"]
    assert result.column("to").to_pylist() == ["r1", "r2"]
    assert result.column("reply_to").to_pylist() == ["red", "blue"]
    assert result.column("correlation_id").to_pylist() == ["1", "2"]
    assert result.column("time_to_live_ms").to_pylist() == [1900, 1900]
    assert result.column("scheduled_enqueue_time_utc").to_pylist() == [T0, T0]
    assert [len(s) for s in result.column("session_id").to_pylist()] == [36, 36]
    assert result.column("content_type").to_pylist() == [None, None]
    assert result.column("reply_to_session_id").to_pylist() == ["x", "x"]
    assert result.column("partition_key").to_pylist() == ["p", "p"]
    assert result.column("message_id").to_pylist() == ["id", "id"]
    assert result.column("sequence_number").equals(SYS.column("sequence_number"))
    assert props_of(result) == props_of(SYS)
    assert SYS.column("subject").to_pylist() == ["l1", "L1"]


def test_set_subject_alias_and_string_conversion() -> None:
    result = SqlRuleAction("SET sys.Subject = 5; SET sys.To = TRUE; SET sys.ReplyTo = 2.5").apply(SYS)
    assert result.column("subject").to_pylist() == ["5", "5"]
    assert result.column("to").to_pylist() == ["true", "true"]
    assert result.column("reply_to").to_pylist() == ["2.5", "2.5"]


def test_action_adds_missing_columns() -> None:
    table = pa.table({"message_id": ["a", "b"]})
    result = SqlRuleAction("SET color = 'red'; SET sys.Label = sys.MessageId").apply(table)
    assert result.column_names == ["message_id", "subject", "application_properties"]
    assert props_of(result) == [{"color": "red"}, {"color": "red"}]
    assert result.column("subject").to_pylist() == ["a", "b"]


def test_action_preserves_non_nullable_schema_and_record_batches() -> None:
    schema = pa.schema([pa.field("subject", pa.string(), nullable=False), pa.field("application_properties", pa.string())])
    table = pa.table({"subject": ["a"], "application_properties": ['{"n": 1}']}, schema=schema)
    result = SqlRuleAction("SET sys.Label = 'b'; SET n = n + 1").apply(table.to_batches()[0])
    assert result.schema == schema
    assert result.column("subject").to_pylist() == ["b"] and props_of(result) == [{"n": 2}]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty SQL action"),
        ("   ", "empty SQL action"),
        ("SET", "expected a property name"),
        ("SET a", "expected '=' after SET a"),
        ("SET a =", "expected a value"),
        ("SET a 1", "expected '='"),
        ("UPDATE a = 1", "expected SET or REMOVE"),
        ("REMOVE", "expected a property name"),
        ("SET a = 1 b", "expected SET or REMOVE but found 'b'"),
        ("SET sys.SequenceNumber = 1", "sys.SequenceNumber is read-only"),
        ("SET sys.EnqueuedTimeUtc = @t", "read-only"),
        ("REMOVE sys.DeliveryCount", "read-only"),
        ("SET sys.Size = 1", "read-only"),
        ("SET sys.Nope = 1", "unknown system property"),
        ("SET a = 'x", "unterminated string"),
    ],
)
def test_action_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(FilterSyntaxError, match=message):
        SqlRuleAction(text, {"t": T0})


# --------------------------------------------------------------------------- syntax errors


@pytest.mark.parametrize(
    ("expression", "message", "position"),
    [
        ("", "empty SQL filter", 1),
        ("   ", "empty SQL filter", 4),
        ("color = 'red", "unterminated string constant", 9),
        ("color == 'red'", "unknown operator '=='", 7),
        ("color ~ 'red'", "unknown operator or character '~'", 7),
        ("color ! 'red'", "use '!=' or '<>'", 7),
        ("color = 'red' extra", "unexpected 'extra' after the end of the expression", 15),
        ("color = 'red';", "unexpected ';'", 14),
        ("color = 'red' 'blue'", "unexpected string 'blue'", 15),
        ("color LIKE 'a' ESCAPE 'ab'", "ESCAPE needs exactly one character", 23),
        ("color LIKE 'a' ESCAPE ''", "ESCAPE needs exactly one character", 23),
        ("color LIKE 'a!' ESCAPE '!'", "ends with the escape character", 12),
        ("color LIKE 5", "expected a string pattern after LIKE", 12),
        ("color LIKE", "expected a string pattern after LIKE but found end of expression", 11),
        ("color LIKE 'a' ESCAPE 1", "one-character string after ESCAPE", 23),
        ("(color = 'red'", "expected ')' to close the '(' at position 1", 15),
        ("color = ", "expected a value", 9),
        ("color = )", "expected a value (constant, property, @parameter, function or '(') but found ')'", 9),
        ("color IN 'a'", "expected '(' after IN", 10),
        ("color IN ('a'", "expected ')' or ',' to continue the IN list", 14),
        ("color IN ()", "expected a value", 11),
        ("color IS 5", "expected NULL after IS", 10),
        ("color IS NOT 5", "expected NULL after IS NOT", 14),
        ("color NOT 5", "expected IN or LIKE after NOT", 11),
        ("sys.Nope = 1", "unknown system property sys.Nope", 5),
        ("foo.bar = 1", "unknown property scope 'foo'", 1),
        ("sys. = 1", "expected a property name after 'sys.'", 6),
        ("AND = 1", "expected a value but found keyword AND", 1),
        ("in = 1", "expected a value but found keyword IN", 1),
        ("5", "expected a condition", 1),
        ("'a' AND qty = 1", "expected a condition", 1),
        ("qty = 1 OR 2", "expected a condition", 12),
        ("NOT 'x'", "expected a condition", 5),
        ("1 + (qty = 1) = 2", "operator '+' needs a value, not a condition", 5),
        ("-(qty = 1) = 2", "operator '-' needs a value, not a condition", 2),
        ("99999999999999999999 = 1", "outside the 64-bit range", 1),
        ("1e = 1", "expected digits in the exponent", 3),
        ("12abc = 1", "invalid number '12a'", 1),
        ("@ = 1", "expected a parameter name after '@'", 1),
        ("color = @nope", "parameter @nope has no value", 9),
        ("[unterminated = 1", "unterminated delimited identifier", 1),
        ('"unterminated = 1', "unterminated quoted identifier", 1),
        ("[] = 1", "empty delimited identifier", 1),
        ("foo(1) = 1", "unknown function 'foo'", 1),
        ("EXISTS(1)", "expected a property name", 8),
        ("EXISTS color", "expected '(' after EXISTS", 8),
        ("newid(1) IS NULL", "newid takes no arguments", 7),
        ("property(1) = 1", "property name string", 10),
        ("a = 1 = 2", "unexpected '='", 7),
    ],
)
def test_filter_syntax_errors(expression: str, message: str, position: int) -> None:
    with pytest.raises(FilterSyntaxError) as caught:
        SqlRuleFilter(expression)
    text = str(caught.value)
    assert message in text
    assert text.endswith(f"at position {position} in SQL expression {expression!r}")
    assert isinstance(caught.value, InvalidOperationError) and isinstance(caught.value, ValueError)


def test_non_string_expression_is_rejected() -> None:
    with pytest.raises(FilterSyntaxError, match="must be a string"):
        SqlRuleFilter(5)  # type: ignore[arg-type]


def test_a_string_plus_a_number_joins_them_as_csharp_does() -> None:
    batch = make_batch({"props": {"s": "order-", "n": 5, "f": 2.5}}, {"props": {"n": 5}})
    assert run("s + n = 'order-5' AND n + s = '5order-' AND s + f = 'order-2.5'", batch) == [T, F]
    assert run("n + n = 10", batch) == [T, T]  # numbers still add


# --------------------------------------------------------------------------- time arithmetic and SET types


def test_time_minus_time_is_a_duration_in_milliseconds() -> None:
    """As C# binds DateTime - DateTime (a TimeSpan); it was NULL, so comparing it with a duration never matched."""
    hour = dt.timedelta(hours=1)
    assert run("sys.ScheduledEnqueueTimeUtc - sys.EnqueuedTimeUtc > @d", SYS, {"d": hour}) == [F, T]
    assert run("sys.ScheduledEnqueueTimeUtc - sys.EnqueuedTimeUtc = 82800000", SYS) == [F, T]  # 23 hours
    assert run("sys.EnqueuedTimeUtc - @t = 0.5", SYS, {"t": T0 - dt.timedelta(microseconds=500)}) == [T, F]
    assert run("@t - sys.EnqueuedTimeUtc < 0", SYS, {"t": T0}) == [F, T]


def test_times_centuries_apart_subtract_to_their_duration() -> None:
    """A difference past 2**53 µs (times ~285 years apart) raised ArrowInvalid for every row, so fan-out dead-lettered the
    message (test_rules has the no-TTL message this hit). Such differences are durations like any other."""
    batch = make_batch({"enqueued_time_utc": T0})
    latest = dt.datetime.max.replace(tzinfo=dt.UTC)  # a no-TTL message's sys.ExpiresAtUtc
    assert run("@latest - sys.EnqueuedTimeUtc > @d", batch, {"latest": latest, "d": dt.timedelta(minutes=1)}) == [T]
    since = dt.datetime(1700, 1, 1, tzinfo=dt.UTC)
    whole_ms = (T0 - since) // dt.timedelta(milliseconds=1)
    assert run("sys.EnqueuedTimeUtc - @since = @ms", batch, {"since": since, "ms": whole_ms}) == [T]
    odd = since + dt.timedelta(microseconds=500)  # not a whole millisecond: the float lane
    between = "sys.EnqueuedTimeUtc - @odd > @below AND sys.EnqueuedTimeUtc - @odd < @ms"  # whole_ms - 0.5
    assert run(between, batch, {"odd": odd, "below": whole_ms - 1, "ms": whole_ms}) == [T]


def test_time_plus_or_minus_a_duration_is_a_time() -> None:
    """As C# binds DateTime +/- TimeSpan; a duration is a timedelta parameter or a number of milliseconds."""
    hour = dt.timedelta(hours=1)
    assert run("sys.EnqueuedTimeUtc + @d = @t", SYS, {"d": hour, "t": T0 + hour}) == [T, F]
    assert run("sys.EnqueuedTimeUtc - 3600000 = @t", SYS, {"t": T0}) == [F, T]
    assert run("sys.EnqueuedTimeUtc + sys.TimeToLive = @t", SYS, {"t": T0 + dt.timedelta(minutes=1)}) == [T, F]
    assert run("sys.EnqueuedTimeUtc + 0.001 > sys.EnqueuedTimeUtc", SYS) == [T, T]


def test_time_arithmetic_outside_the_representable_years_or_with_a_non_number_is_null() -> None:
    batch = make_batch({"enqueued_time_utc": T0, "props": {"d": 9223372036854775807, "s": "1", "f": 1e300}})
    for expression in [
        "sys.EnqueuedTimeUtc + d",
        "sys.EnqueuedTimeUtc + s",
        "sys.EnqueuedTimeUtc - f",
        "sys.EnqueuedTimeUtc + @far",
    ]:
        assert run(f"{expression} IS NULL", batch, {"far": dt.timedelta(days=3_000_000)}) == [T], expression


@pytest.mark.parametrize(
    "expression",
    [
        "sys.EnqueuedTimeUtc + sys.EnqueuedTimeUtc > @t",
        "1 - sys.EnqueuedTimeUtc > 0",
        "a + sys.EnqueuedTimeUtc > @t",
        "sys.EnqueuedTimeUtc * 2 > @t",
        "sys.EnqueuedTimeUtc / 2 > @t",
        "sys.EnqueuedTimeUtc + 'x' = 'y'",
        "-sys.EnqueuedTimeUtc < 0",
    ],
)
def test_time_arithmetic_csharp_does_not_define_is_refused(expression: str) -> None:
    with pytest.raises(FilterSyntaxError, match="time"):
        SqlRuleFilter(expression, {"t": T0})


def test_an_action_sets_a_time_computed_from_another() -> None:
    """SET sys.ScheduledEnqueueTimeUtc = sys.EnqueuedTimeUtc + @d stored NULL: a copy meant to wait was delivered at once."""
    action = SqlRuleAction(
        "SET sys.ScheduledEnqueueTimeUtc = sys.EnqueuedTimeUtc + @d; "
        "SET wait = sys.ScheduledEnqueueTimeUtc - sys.EnqueuedTimeUtc",
        {"d": dt.timedelta(minutes=5)},
    )
    result = action.apply(SYS)
    assert result.column("scheduled_enqueue_time_utc").to_pylist() == [T0 + dt.timedelta(minutes=m) for m in (5, 65)]
    assert [p and p["wait"] for p in props_of(result)] == [300000, 300000]


@pytest.mark.parametrize(
    "text",
    [
        "SET sys.TimeToLive = sys.Label",
        "SET sys.TimeToLive = sys.EnqueuedTimeUtc",
        "SET sys.TimeToLive = 'a' + sys.Label",
        "SET sys.TimeToLive = a = 1",
        "SET sys.ScheduledEnqueueTimeUtc = sys.TimeToLive",
        "SET sys.ScheduledEnqueueTimeUtc = sys.ExpiresAtUtc - sys.EnqueuedTimeUtc",
        "SET sys.ScheduledEnqueueTimeUtc = newid()",
        "SET sys.ScheduledEnqueueTimeUtc = -qty",
        "SET sys.ScheduledEnqueueTimeUtc = a + b",
    ],
)
def test_setting_a_system_property_to_an_expression_of_another_type_is_refused(text: str) -> None:
    """Only constants were checked: these were accepted and cleared the property on every message."""
    with pytest.raises(FilterSyntaxError, match=r"takes a (number|time) value, not a"):
        SqlRuleAction(text)


@pytest.mark.parametrize(
    "text",
    [
        "SET sys.TimeToLive = sys.ExpiresAtUtc - sys.EnqueuedTimeUtc",
        "SET sys.TimeToLive = qty * 1000",
        "SET sys.TimeToLive = @d",
        "SET sys.TimeToLive = NULL",
        "SET sys.ScheduledEnqueueTimeUtc = sys.EnqueuedTimeUtc - @d",
        "SET sys.ScheduledEnqueueTimeUtc = when",
        "SET sys.Label = sys.EnqueuedTimeUtc + @d",
    ],
)
def test_setting_a_system_property_to_a_value_it_can_hold_is_accepted(text: str) -> None:
    SqlRuleAction(text, {"d": dt.timedelta(seconds=1)})


def test_setting_a_system_property_to_an_application_property_of_another_type_raises_instead_of_clearing_it() -> None:
    """Its type is known only per message: the action raises, so fan-out dead-letters that message (docs/semantics.md §8)."""
    batch = make_batch({"time_to_live_ms": 1000, "props": {"ttl": 5}}, {"time_to_live_ms": 1000, "props": {"ttl": "5"}})
    with pytest.raises(InvalidOperationError, match=r"sys\.TimeToLive takes a number value, but a message's value is a string"):
        SqlRuleAction("SET sys.TimeToLive = ttl").apply(batch)
    assert SqlRuleAction("SET sys.TimeToLive = ttl").apply(batch.slice(0, 1)).column("time_to_live_ms").to_pylist() == [5]
    assert SqlRuleAction("SET sys.TimeToLive = missing").apply(batch).column("time_to_live_ms").to_pylist() == [None, None]
