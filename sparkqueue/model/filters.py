"""Service Bus subscription rule filters and actions, evaluated vectorized over pyarrow batches.

A batch has one row per message (columns ``message_id``, ``subject``, ``sequence_number``, ...,
``application_properties`` as a JSON object string).  Filters are parsed once at construction
(``sparkqueue.model.sql_parser``) and every ``evaluate`` compiles the tree to whole-column
``pyarrow.compute`` calls; nothing is evaluated row by row.

Values are dynamically typed per row (``qty`` may be ``5`` in one message and ``"5"`` in the
next), so an expression evaluates to a ``_Value``: one array per type *lane* (string, int, float,
bool, time) where each row is set in at most one lane and a row set in none is SQL NULL/unknown.

Application properties are the one non-vectorized step: the JSON column is decoded once per batch
(one ``json.loads`` over the whole column, falling back to one per row if a row is malformed), and
only when the expression references an application property; then one Python pass per referenced
key splits its values into the type lanes.  Property names are case-insensitive as in Service Bus
(an exact-case key wins over other spellings).

Semantics (Service Bus / JMS selector rules):

* NULL, a missing property or a missing column is *unknown*; AND/OR/NOT are three-valued and a
  filter whose result is unknown does not match.  ``IS [NOT] NULL`` and ``EXISTS`` are never
  unknown; ``EXISTS(user.x)`` is true for a key present with a JSON null, ``EXISTS(sys.X)`` means
  "is not null".  Values that are not booleans count as unknown where a condition is expected.
* Operands of unlike types (string vs number, bool vs string, ...) compare false under every
  operator, ``<>`` included.  int and float compare numerically; bools support only ``=``/``<>``.
  String comparison is case-sensitive (code-point order).
* ``x IN (...)`` is unknown only when ``x`` is NULL (NULL list items never match); ``NOT IN`` and
  ``NOT LIKE`` negate IN/LIKE.  LIKE on a non-string value is false.
* Arithmetic: int64 with int64 stays int64 (wrapping on overflow, truncating division, ``%`` takes
  the dividend's sign, like C#); with a float operand it is float64 (x/0.0 is inf/NaN); integer
  division or modulo by zero is NULL; ``+`` concatenates two strings; time - time is a duration and
  time +/- a duration a time (durations in milliseconds, NULL outside years 1-9999); other combinations are NULL.
* JSON values that are arrays or objects count as NULL; integers beyond 64 bits become floats.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce, singledispatch
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import FilterSyntaxError, InvalidArgumentTypeError, InvalidOperationError
from sparkqueue.model import limits
from sparkqueue.model.sql_parser import (
    SYSTEM_PROPERTIES,
    And,
    Arith,
    Compare,
    Const,
    Exists,
    InList,
    IsNull,
    Like,
    NewId,
    Node,
    Not,
    Or,
    SetStatement,
    Statement,
    SysProp,
    SystemProperty,
    Unary,
    UserProp,
    balanced,
    normalize_value,
    parse_action,
    parse_condition,
    system_properties_read,
)
from sparkqueue.storage.schema import constant

__all__ = [
    "CorrelationRuleFilter",
    "FalseRuleFilter",
    "FilterSyntaxError",
    "RuleFilter",
    "SqlRuleAction",
    "SqlRuleFilter",
    "TrueRuleFilter",
    "action_from_dict",
    "filter_from_dict",
]

Batch: TypeAlias = pa.Table | pa.RecordBatch
APPLICATION_PROPERTIES = "application_properties"
_TIME = pa.timestamp("us", tz="UTC")
_LANE_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "time": _TIME,
}
_KIND_TO_LANE = {"string": "string", "number": "int", "time": "time"}
_NULL_BOOL = pa.scalar(None, pa.bool_())
_INT64_RANGE = range(-(2**63), 2**63)
_INT64_MAX = pa.scalar(2**63 - 1, pa.int64())
_INT64_MIN = pa.scalar(-(2**63), pa.int64())
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EARLIEST_US = (dt.datetime(1, 1, 1, tzinfo=dt.UTC) - _EPOCH) // dt.timedelta(microseconds=1)  # C# DateTime.MinValue
_LATEST_US = (dt.datetime.max.replace(tzinfo=dt.UTC) - _EPOCH) // dt.timedelta(microseconds=1)  # C# DateTime.MaxValue
_SPAN_US = _LATEST_US - _EARLIEST_US  # no time moved further stays a time
# A message without a time to live has the entity's default, TimeSpan.MaxValue unless one is set, and expires at
# DateTime.MaxValue (Service Bus): a filter reads those, not NULL (docs/semantics.md §8).
_UNSET: dict[str, object] = {
    "time_to_live_ms": (2**63 - 1) // 10_000,  # TimeSpan.MaxValue (ticks of 100 ns) in milliseconds
    "expires_at_utc": dt.datetime.max.replace(tzinfo=dt.UTC),
}
_MISSING = object()  # marks an absent application property (distinct from a JSON null)


class ActionValueTooLargeError(InvalidOperationError):
    """A rule action made a string no message could hold: fan-out dead-letters that copy (docs/semantics.md §8)."""


# --------------------------------------------------------------------------- typed values


@dataclass(frozen=True)
class _Value:
    """Per-row dynamically typed values: each row is non-null in at most one lane; in none = NULL."""

    length: int
    lanes: Mapping[str, pa.Array]

    @classmethod
    def null(cls, length: int) -> _Value:
        """All rows NULL."""
        return cls(length, {})

    @classmethod
    def boolean(cls, array: pa.Array) -> _Value:
        """A condition result (true/false/unknown per row)."""
        return cls(len(array), {"bool": array})

    def lane(self, kind: str) -> pa.Array | None:
        """The lane array of ``kind`` if any row has that type."""
        return self.lanes.get(kind)

    def valid(self) -> pa.Array:
        """Boolean (never null): the row has a non-NULL value."""
        if not self.lanes:
            return constant(False, pa.bool_(), self.length)
        return reduce(pc.or_, [pc.is_valid(array) for array in self.lanes.values()])

    def truth(self) -> pa.Array:
        """Condition value per row: the bool lane; any other type counts as unknown."""
        return self.lanes.get("bool", pa.nulls(self.length, pa.bool_()))

    def as_float(self) -> pa.Array | None:
        """Numeric rows as float64 (ints widened), or None when no row is numeric."""
        parts = [pc.cast(self.lanes[kind], pa.float64(), safe=False) for kind in ("float", "int") if kind in self.lanes]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else pc.coalesce(*parts)

    def to_pylist(self) -> list[Any]:
        """Python value per row (None for NULL), for writing properties back."""
        out: list[Any] = [None] * self.length
        for array in self.lanes.values():
            for index, item in enumerate(array.to_pylist()):
                if item is not None:
                    out[index] = item
        return out


def _lane_of(value: object) -> tuple[str, object] | None:
    """(lane, value) for a Python value; None for NULL and unsupported JSON (lists, objects)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return ("int", value) if value in _INT64_RANGE else ("float", float(value))
    if isinstance(value, float):
        return "float", value
    if isinstance(value, str):
        return "string", value
    if isinstance(value, dt.datetime):
        return "time", value
    return None


_PY_LANES = ((str, "string"), (bool, "bool"), (int, "int"), (float, "float"), (dt.datetime, "time"))


def _value_from_python(values: list[Any]) -> _Value:
    """Split a list of mixed Python values into typed lanes; integers beyond 64 bits become floats."""
    try:
        return _split_lanes(values)
    except OverflowError:
        return _split_lanes([float(item) if type(item) is int and item not in _INT64_RANGE else item for item in values])


def _split_lanes(values: list[Any]) -> _Value:
    """One list comprehension per Python type present; other types (lists, objects) count as NULL."""
    present = set(map(type, values))
    lanes = {
        kind: pa.array([item if type(item) is py_type else None for item in values], _LANE_TYPES[kind])
        for py_type, kind in _PY_LANES
        if py_type in present
    }
    return _Value(len(values), lanes)


def _constant(value: object, length: int) -> _Value:
    """A constant broadcast to every row."""
    typed = _lane_of(value)
    if typed is None:
        return _Value.null(length)
    return _Value(length, {typed[0]: constant(typed[1], _LANE_TYPES[typed[0]], length)})


# --------------------------------------------------------------------------- batch access


def _as_table(batch: Batch) -> pa.Table:
    """Accept a Table or RecordBatch."""
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if isinstance(batch, pa.Table):
        return batch
    raise TypeError(f"expected a pyarrow Table or RecordBatch, got {type(batch).__name__}")


def _decode_properties(array: pa.Array) -> list[dict[str, Any] | None]:
    """Decode the JSON property column: one json.loads for the batch, per row only if a row is bad."""
    texts = array.to_pylist()
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        try:
            parsed = json.loads("[" + ",".join(text or "null" for text in texts) + "]")
        except ValueError:
            parsed = None
        if parsed is not None and len(parsed) == len(texts):
            return [item if isinstance(item, dict) else None for item in parsed]
    return [_decode_one(text) for text in texts]


def _decode_one(text: Any) -> dict[str, Any] | None:
    """Decode one row's properties; malformed or non-object JSON counts as no properties."""
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _resolve_key(row: dict[str, Any] | None, name: str) -> str | None:
    """The row's key for property ``name``: exact spelling first, else case-insensitive."""
    if not row:
        return None
    if name in row:
        return name
    lowered = name.lower()
    return next((key for key in row if key.lower() == lowered), None)


def _json_ready(value: object) -> object:
    """Make an evaluated value JSON-serialisable (datetimes become ISO 8601 strings)."""
    return value.isoformat() if isinstance(value, dt.datetime) else value


class _Context:
    """One batch under evaluation: normalized system columns, lazily decoded application properties.

    Rule actions mutate the context (``set_*``/``remove_user``) and read the result with ``to_table``.
    """

    def __init__(self, table: pa.Table, max_text_bytes: int | None = None) -> None:
        self.table = table
        self.num_rows = table.num_rows
        self.max_text_bytes = max_text_bytes  # a rule action's bound on the strings it makes (SqlRuleAction.apply)
        self._columns: dict[str, _Value] = {}
        self._overrides: dict[str, pa.Array] = {}
        self._rows: list[dict[str, Any] | None] | None = None
        self._dirty_rows: set[int] = set()
        self._user: dict[str, tuple[_Value, pa.Array]] = {}

    def column(self, name: str) -> pa.Array | None:
        """A batch column as one contiguous array, or None if the batch lacks it."""
        if name in self._overrides:
            return self._overrides[name]
        if name not in self.table.column_names:
            return None
        return self.table.column(name).combine_chunks()

    def system(self, prop: SystemProperty) -> _Value:
        """Value of a system property (a missing column is NULL; an unset time to live reads as Service Bus's maximum)."""
        if prop.column not in self._columns:
            array = self.column(prop.column)
            lane = _KIND_TO_LANE[prop.kind]
            if array is None:
                self._columns[prop.column] = _Value.null(self.num_rows)
            else:
                target = _LANE_TYPES[lane]
                array = array if array.type == target else pc.cast(array, target, safe=False)
                unset = _UNSET.get(prop.column)
                if unset is not None and array.null_count:
                    array = pc.fill_null(array, pa.scalar(unset, target))
                self._columns[prop.column] = _Value(self.num_rows, {lane: array})
        return self._columns[prop.column]

    def rows(self) -> list[dict[str, Any] | None]:
        """Decoded application properties per row (decoded once per batch)."""
        if self._rows is None:
            array = self.column(APPLICATION_PROPERTIES)
            self._rows = [None] * self.num_rows if array is None else _decode_properties(array)
        return self._rows

    def user(self, name: str) -> tuple[_Value, pa.Array]:
        """(value, exists) of an application property; cached per name for the batch."""
        if name not in self._user:
            rows = self.rows()
            values = [row.get(name, _MISSING) if row else _MISSING for row in rows]
            for index in [index for index, item in enumerate(values) if item is _MISSING]:
                key = _resolve_key(rows[index], name)  # case-insensitive fallback
                if key is not None:
                    values[index] = rows[index][key]  # type: ignore[index]
            exists = pa.array([item is not _MISSING for item in values], pa.bool_())
            values = [None if item is _MISSING else item for item in values]
            self._user[name] = (_value_from_python(values), exists)
        return self._user[name]

    def set_user(self, name: str, value: _Value) -> None:
        """SET an application property on every row."""
        rows = self.rows()
        for index, item in enumerate(value.to_pylist()):
            row = rows[index] if rows[index] is not None else {}
            rows[index] = row
            row[_resolve_key(row, name) or name] = _json_ready(item)  # type: ignore[index]
            self._dirty_rows.add(index)
        self._user.clear()

    def remove_user(self, name: str) -> None:
        """REMOVE an application property from the rows that have it."""
        for index, row in enumerate(self.rows()):
            key = _resolve_key(row, name)
            if key is not None and row is not None:
                del row[key]
                self._dirty_rows.add(index)
        self._user.clear()

    def set_system(self, prop: SystemProperty, value: _Value) -> None:
        """SET (or clear) a settable system property column."""
        _check_holdable(prop, value)
        array = _coerce(value, prop.kind)
        existing = self.table.schema.field(prop.column).type if prop.column in self.table.column_names else None
        self._overrides[prop.column] = array if existing is None else pc.cast(array, existing, safe=False)
        self._columns.pop(prop.column, None)

    def to_table(self) -> pa.Table:
        """The batch with every change applied."""
        table = self.table
        for name, array in self._overrides.items():
            table = _put_column(table, name, array)
        if self._dirty_rows:
            table = _put_column(table, APPLICATION_PROPERTIES, self._encoded_properties())
        return table

    def _encoded_properties(self) -> pa.Array:
        """Re-encode changed rows as JSON; untouched rows keep their original text."""
        original = self.column(APPLICATION_PROPERTIES)
        texts = [None] * self.num_rows if original is None else original.to_pylist()
        for index in self._dirty_rows:
            row = self.rows()[index]
            texts[index] = json.dumps(row, ensure_ascii=False) if row else None
        return pa.array(texts, pa.string())


def _check_holdable(prop: SystemProperty, value: _Value) -> None:
    """Raise when a message's value is of a type the property cannot hold, rather than silently clearing it.

    The parser refuses such values when their type is known; this catches application properties.
    Fan-out then handles the message as any rule that raised (docs/semantics.md §8).
    """
    wrong = sorted(
        lane for lane, array in value.lanes.items() if lane not in _ACCEPTED_LANES[prop.kind] and array.null_count < len(array)
    )
    if wrong:
        raise InvalidOperationError(
            f"SET sys.{prop.name} takes a {prop.kind} value, but a message's value is a {' or '.join(wrong)}: nothing stored"
        )


def _put_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    """Replace column ``name`` or append it when the batch lacks it."""
    if name in table.column_names:
        index = table.column_names.index(name)
        return table.set_column(index, table.schema.field(name).with_type(array.type), array)
    return table.append_column(pa.field(name, array.type), array)


# The value lanes a system property of each kind can hold (_coerce converts them).
_ACCEPTED_LANES = {
    "string": ("string", "int", "float", "bool", "time"),
    "number": ("int", "float"),
    "time": ("time",),
}


def _coerce(value: _Value, kind: str) -> pa.Array:
    """Convert a value to a system column's type (strings accept any scalar, ints truncate floats)."""
    target = _LANE_TYPES[_KIND_TO_LANE[kind]]
    lanes = dict(value.lanes)
    if kind == "number" and "float" in lanes:
        lanes["float"] = _int64_saturated(lanes["float"])
    parts = [pc.cast(lanes[lane], target, safe=False) for lane in _ACCEPTED_LANES[kind] if lane in lanes]
    if not parts:
        return pa.nulls(value.length, target)
    out = parts[0] if len(parts) == 1 else pc.coalesce(*parts)
    if kind == "time":  # datetime.max ("never") is stored as the latest storable instant, as a send stores it
        latest = pa.scalar(limits.LATEST_TIME, target)
        out = pc.if_else(pc.fill_null(pc.greater(out, latest), False), latest, out)
    return out


def _int64_saturated(floats: pa.Array) -> pa.Array:
    """Floats as int64, truncated, and those beyond the int64 range held at its ends (an unsafe cast would wrap them).

    SET sys.TimeToLive = 1e300 then means "never expires", as any value past TimeSpan.MaxValue does.
    NaN has no number to hold: it raises, and fan-out handles the message as any rule that raised.
    """
    if pc.any(pc.is_nan(floats)).as_py():
        raise InvalidOperationError("a rule set a number property to NaN, which has no integer value: nothing stored")
    high = pc.greater_equal(floats, 2.0**63)
    low = pc.less(floats, -(2.0**63))
    inside = pc.cast(pc.if_else(pc.or_(high, low), 0.0, floats), pa.int64(), safe=False)
    return pc.if_else(high, _INT64_MAX, pc.if_else(low, _INT64_MIN, inside))


# --------------------------------------------------------------------------- expression compiler


@singledispatch
def _eval(node: Node, ctx: _Context) -> _Value:
    """Evaluate a syntax-tree node over the whole batch."""
    raise TypeError(f"cannot evaluate {type(node).__name__}")


@_eval.register
def _eval_const(node: Const, ctx: _Context) -> _Value:
    return _constant(node.value, ctx.num_rows)


@_eval.register
def _eval_sys(node: SysProp, ctx: _Context) -> _Value:
    return ctx.system(node.prop)


@_eval.register
def _eval_user(node: UserProp, ctx: _Context) -> _Value:
    return ctx.user(node.name)[0]


@_eval.register
def _eval_newid(node: NewId, ctx: _Context) -> _Value:
    ids = pa.array([str(uuid.uuid4()) for _ in range(ctx.num_rows)], pa.string())
    return _Value(ctx.num_rows, {"string": ids})


@_eval.register
def _eval_unary(node: Unary, ctx: _Context) -> _Value:
    operand = _eval(node.operand, ctx)
    numeric = {kind: operand.lanes[kind] for kind in ("int", "float") if kind in operand.lanes}
    if node.op == "-":
        numeric = {kind: pc.negate(array) for kind, array in numeric.items()}
    return _Value(operand.length, numeric)


@_eval.register
def _eval_arith(node: Arith, ctx: _Context) -> _Value:
    value = _arith(node.op, _eval(node.left, ctx), _eval(node.right, ctx))
    joined = value.lane("string") if node.op == "+" else None
    if joined is not None and ctx.max_text_bytes is not None:
        longest = pc.max(pc.binary_length(joined)).as_py()
        if longest is not None and longest > ctx.max_text_bytes:
            raise ActionValueTooLargeError(
                f"the rule action joined a string of {longest} bytes; a message holds at most {ctx.max_text_bytes}"
            )
    return value


@_eval.register
def _eval_compare(node: Compare, ctx: _Context) -> _Value:
    return _compare(node.op, _eval(node.left, ctx), _eval(node.right, ctx))


@_eval.register
def _eval_and(node: And, ctx: _Context) -> _Value:
    return _Value.boolean(pc.and_kleene(_eval(node.left, ctx).truth(), _eval(node.right, ctx).truth()))


@_eval.register
def _eval_or(node: Or, ctx: _Context) -> _Value:
    return _Value.boolean(pc.or_kleene(_eval(node.left, ctx).truth(), _eval(node.right, ctx).truth()))


@_eval.register
def _eval_not(node: Not, ctx: _Context) -> _Value:
    return _Value.boolean(pc.invert(_eval(node.operand, ctx).truth()))


@_eval.register
def _eval_is_null(node: IsNull, ctx: _Context) -> _Value:
    valid = _eval(node.operand, ctx).valid()
    return _Value.boolean(valid if node.negated else pc.invert(valid))


@_eval.register
def _eval_exists(node: Exists, ctx: _Context) -> _Value:
    if isinstance(node.prop, UserProp):
        return _Value.boolean(ctx.user(node.prop.name)[1])
    return _Value.boolean(ctx.system(node.prop.prop).valid())


@_eval.register
def _eval_like(node: Like, ctx: _Context) -> _Value:
    operand = _eval(node.operand, ctx)
    strings = operand.lane("string")
    if strings is None:
        found = constant(False, pa.bool_(), operand.length)
    else:
        found = pc.fill_null(pc.match_like(strings, node.pattern), False)
    return _known_only(operand, found, node.negated)


@_eval.register
def _eval_in(node: InList, ctx: _Context) -> _Value:
    operand = _eval(node.operand, ctx)
    constants = [item.value for item in node.items if isinstance(item, Const)]
    hits = [_in_constants(operand, constants)]
    for item in node.items:
        if not isinstance(item, Const):
            hits.append(pc.fill_null(_compare("=", operand, _eval(item, ctx)).truth(), False))
    return _known_only(operand, reduce(pc.or_, hits), node.negated)


def _known_only(operand: _Value, found: pa.Array, negated: bool) -> _Value:
    """IN/LIKE result: unknown when the operand is NULL, else ``found`` (inverted for NOT)."""
    result = pc.if_else(operand.valid(), found, _NULL_BOOL)
    return _Value.boolean(pc.invert(result) if negated else result)


def _in_constants(operand: _Value, constants: list[object]) -> pa.Array:
    """Membership of each row in a constant list, with pc.is_in per type lane (never null)."""
    sets: dict[str, list[Any]] = {kind: [] for kind in _LANE_TYPES}
    for value in constants:
        typed = _lane_of(value)
        if typed is not None:
            sets[typed[0]].append(typed[1])
    floats = sets["float"] + [float(item) for item in sets["int"]]
    checks: list[tuple[str, list[Any], pa.DataType]] = [
        ("string", sets["string"], pa.string()),
        ("bool", sets["bool"], pa.bool_()),
        ("time", sets["time"], _TIME),
        ("int", sets["int"], pa.int64()),
        ("float", floats, pa.float64()),
    ]
    hits = [constant(False, pa.bool_(), operand.length)]
    for lane, values, type_ in checks:
        if lane in operand.lanes and values:
            hits.append(pc.is_in(operand.lanes[lane], value_set=pa.array(values, type_)))
    if "int" in operand.lanes and sets["float"]:
        widened = pc.cast(operand.lanes["int"], pa.float64(), safe=False)
        hits.append(pc.is_in(widened, value_set=pa.array(sets["float"], pa.float64())))
    return reduce(pc.or_, hits)


_COMPARATORS: dict[str, Callable[..., pa.Array]] = {
    "=": pc.equal,
    "<>": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}


def _same_type_comparisons(op: str, left: _Value, right: _Value) -> list[pa.Array]:
    """Comparison results for rows whose operands have compatible types (null elsewhere).

    Order matters for the coalesce: exact int/int first, then int/float widened to float.
    Booleans only support = and <>.
    """
    compare = _COMPARATORS[op]
    kinds = ["string", "time", "int"] + (["bool"] if op in ("=", "<>") else [])
    results = [compare(left.lanes[kind], right.lanes[kind]) for kind in kinds if kind in left.lanes and kind in right.lanes]
    if "float" in left.lanes or "float" in right.lanes:
        left_float, right_float = left.as_float(), right.as_float()
        if left_float is not None and right_float is not None:
            results.append(compare(left_float, right_float))
    return results


def _compare(op: str, left: _Value, right: _Value) -> _Value:
    """SQL comparison: unknown if either side is NULL; operands of unlike types are not equal (so <> is NOT =, as NOT IN)."""
    results = _same_type_comparisons(op, left, right)
    unlike = pa.scalar(op in ("<>", "!="))
    same = pc.coalesce(*results, unlike) if results else unlike
    both = pc.and_(left.valid(), right.valid())
    return _Value.boolean(pc.if_else(both, same, _NULL_BOOL))


def _nonzero(divisor: pa.Array) -> pa.Array:
    """The divisor with zeros as NULL: integer division by zero is unknown, not an error.

    C# would raise, but it evaluates AND/OR lazily, so a guarded division (`b <> 0 AND a / b > 2`)
    never divides; a whole-batch evaluation divides every row, so raising would fail guarded rules.
    """
    return pc.if_else(pc.equal(divisor, 0), pa.scalar(None, divisor.type), divisor)


def _int_op(op: str, left: pa.Array, right: pa.Array) -> pa.Array:
    """64-bit integer arithmetic with C# semantics (wrapping, truncating division, dividend-signed %)."""
    if op == "/":
        return pc.divide(left, _nonzero(right))
    if op == "%":
        divisor = _nonzero(right)
        return pc.subtract(left, pc.multiply(pc.divide(left, divisor), divisor))
    return {"+": pc.add, "-": pc.subtract, "*": pc.multiply}[op](left, right)


def _float_op(op: str, left: pa.Array, right: pa.Array) -> pa.Array:
    """Double arithmetic with IEEE semantics (x/0 is ±inf, % is fmod)."""
    if op == "%":
        return pc.subtract(left, pc.multiply(pc.trunc(pc.divide(left, right)), right))
    return {"+": pc.add, "-": pc.subtract, "*": pc.multiply, "/": pc.divide}[op](left, right)


def _arith(op: str, left: _Value, right: _Value) -> _Value:
    """Arithmetic per type lane: int op int stays int, any float widens, '+' joins two strings, times as C# binds them."""
    value = _plain_arith(op, left, right)
    if "time" not in left.lanes or op not in ("+", "-"):
        return value
    parts: dict[str, list[pa.Array]] = {lane: [array] for lane, array in value.lanes.items()}
    for lane, array in _time_arith(op, left.lanes["time"], right).items():
        parts.setdefault(lane, []).append(array)  # rows are in one lane of each operand: the parts never overlap
    return _Value(left.length, {lane: arrays[0] if len(arrays) == 1 else pc.coalesce(*arrays) for lane, arrays in parts.items()})


def _time_arith(op: str, times: pa.Array, right: _Value) -> dict[str, pa.Array]:
    """time - time is a duration (milliseconds, as sys.TimeToLive), time +/- a duration in milliseconds is a time."""
    lanes: dict[str, pa.Array] = {}
    other = right.lane("time")
    if op == "-" and other is not None:
        lanes.update(_duration_ms(pc.subtract(_epoch_us(times), _epoch_us(other))))
    shift = _duration_us(right)
    if shift is not None:
        moved = pc.add(_epoch_us(times), shift if op == "+" else pc.negate(shift))
        in_range = pc.and_(pc.greater_equal(moved, _EARLIEST_US), pc.less_equal(moved, _LATEST_US))
        lanes["time"] = pc.if_else(in_range, moved, pa.scalar(None, pa.int64())).cast(_TIME)  # outside years 1-9999: NULL
    return lanes


def _epoch_us(times: pa.Array) -> pa.Array:
    """Times as int64 microseconds since the epoch."""
    return pc.cast(times, pa.int64())


def _duration_ms(micros: pa.Array) -> dict[str, pa.Array]:
    """A duration in microseconds as milliseconds: whole ones in the int lane, others in the float lane."""
    millis = pc.divide(micros, 1000)
    whole = pc.equal(pc.multiply(millis, 1000), micros)
    # Unsafe: a difference past 2**53 µs (times ~285 years apart, as a no-TTL message's expiry and its enqueue time)
    # has no exact float, and a safe cast raised for every row, whole ones included (docs/semantics.md §8).
    fraction = pc.divide(pc.cast(micros, pa.float64(), safe=False), 1000.0)
    return {
        "int": pc.if_else(whole, millis, pa.scalar(None, pa.int64())),
        "float": pc.if_else(whole, pa.scalar(None, pa.float64()), fraction),
    }


def _duration_us(value: _Value) -> pa.Array | None:
    """A value's numbers (milliseconds) as int64 microseconds; NULL where no time could move that far (nor NaN)."""
    parts = []
    if "int" in value.lanes:
        millis = value.lanes["int"]
        fits = pc.and_(pc.greater_equal(millis, -(_SPAN_US // 1000)), pc.less_equal(millis, _SPAN_US // 1000))
        parts.append(pc.if_else(fits, pc.multiply(millis, 1000), pa.scalar(None, pa.int64())))
    if "float" in value.lanes:
        micros = pc.round(pc.multiply(value.lanes["float"], 1000.0))
        fits = pc.fill_null(pc.less_equal(pc.abs(micros), float(_SPAN_US)), False)  # NaN compares false
        parts.append(pc.cast(pc.if_else(fits, micros, pa.scalar(None, pa.float64())), pa.int64()))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else pc.coalesce(*parts)


def _plain_arith(op: str, left: _Value, right: _Value) -> _Value:
    """Arithmetic of numbers and strings per type lane: int op int stays int, any float widens, '+' joins strings."""
    lanes: dict[str, pa.Array] = {}
    left_int, right_int = left.lane("int"), right.lane("int")
    if left_int is not None and right_int is not None:
        lanes["int"] = _int_op(op, left_int, right_int)
    if "float" in left.lanes or "float" in right.lanes:
        left_float, right_float = left.as_float(), right.as_float()
        if left_float is not None and right_float is not None:
            result = _float_op(op, left_float, right_float)
            if left_int is not None and right_int is not None:
                both_int = pc.and_(pc.is_valid(left_int), pc.is_valid(right_int))
                result = pc.if_else(both_int, pa.scalar(None, pa.float64()), result)
            lanes["float"] = result
    if op == "+":  # a string joined with a string or a number (C#: "order-" + 5 is "order-5")
        left_str, right_str = left.lane("string"), right.lane("string")
        left_num, right_num = _number_text(left), _number_text(right)
        joined = [
            pc.binary_join_element_wise(a, b, "")
            for a, b in ((left_str, right_str), (left_str, right_num), (left_num, right_str))
            if a is not None and b is not None
        ]
        if joined:
            lanes["string"] = joined[0] if len(joined) == 1 else pc.coalesce(*joined)
    return _Value(left.length, lanes)


def _number_text(value: _Value) -> pa.Array | None:
    """A value's numbers as text (None when it has no number lane)."""
    texts = [pc.cast(value.lanes[lane], pa.string()) for lane in ("int", "float") if lane in value.lanes]
    if not texts:
        return None
    return texts[0] if len(texts) == 1 else pc.coalesce(*texts)


def _matches(tree: Node, batch: Batch) -> pa.Array:
    """Evaluate a condition tree; NULL (unknown) counts as no match.

    Conditions only read their context, so filters evaluated one after another over the same table
    (a topic's rules in fan-out) share it: the properties are decoded once per batch, not per rule.
    """
    table = _as_table(batch)
    ctx: _Context | None = getattr(_last_context, "ctx", None)
    if ctx is None or ctx.table is not table:
        ctx = _last_context.ctx = _Context(table)
    return pc.fill_null(_eval(tree, ctx).truth(), False)


_last_context = threading.local()  # this thread's last filter context (it holds its table, so `is` is safe)


# --------------------------------------------------------------------------- JSON descriptions


def _encode_value(value: object) -> object:
    """JSON form of a parameter/property value (datetime, timedelta and UUID are tagged)."""
    if isinstance(value, dt.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {"$timedelta_us": value // dt.timedelta(microseconds=1)}
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    return value


def _decode_value(value: object) -> object:
    """Inverse of ``_encode_value``."""
    if isinstance(value, dict) and len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "$datetime":
            return dt.datetime.fromisoformat(payload)
        if tag == "$timedelta_us":
            return dt.timedelta(microseconds=payload)
        if tag == "$uuid":
            return uuid.UUID(payload)
    return value


def _encode_mapping(values: Mapping[str, object] | None) -> Any:
    """Encode a parameters/properties mapping (None, or a non-mapping set later, stays as is: the constructor refuses it)."""
    return {key: _encode_value(item) for key, item in values.items()} if isinstance(values, Mapping) else values


def _decode_mapping(values: Mapping[str, object] | None) -> Any:
    """Decode a parameters/properties mapping (anything else stays as is)."""
    return {key: _decode_value(item) for key, item in values.items()} if isinstance(values, Mapping) else values


def _as_dict(values: object, what: str) -> dict[str, Any] | None:
    """A copy of a parameters/properties mapping (None stays None); InvalidArgumentTypeError for anything else."""
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise InvalidArgumentTypeError(f"{what} must be a dict, got {type(values).__name__}")
    return dict(values)


# --------------------------------------------------------------------------- public API


@dataclass
class SqlRuleFilter:
    """A SQL filter expression (Service Bus SqlRuleFilter), parsed once and evaluated per batch."""

    sql_expression: str
    parameters: dict[str, Any] | None = None
    _tree: Node = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.parameters = _as_dict(self.parameters, f"{type(self).__name__}.parameters")
        self._tree = parse_condition(self.sql_expression, self.parameters)

    def system_properties(self) -> set[str]:
        """The Service Bus names of the sys properties the condition reads."""
        return system_properties_read(self._tree)

    def evaluate(self, batch: Batch) -> pa.Array:
        """Boolean per message: does the filter match (unknown counts as no match)?"""
        return _matches(self._tree, batch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description for the rule catalog (see ``filter_from_dict``)."""
        return {
            "type": "SqlRuleFilter",
            "sql_expression": self.sql_expression,
            "parameters": _encode_mapping(self.parameters),
        }


class TrueRuleFilter(SqlRuleFilter):
    """Filter that matches every message (SQL ``1=1``), the default rule of a subscription."""

    def __init__(self) -> None:
        super().__init__("1=1")

    def __repr__(self) -> str:
        return "TrueRuleFilter()"

    def evaluate(self, batch: Batch) -> pa.Array:
        """All true, without evaluating anything."""
        return constant(True, pa.bool_(), _as_table(batch).num_rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description."""
        return {"type": "TrueRuleFilter"}


class FalseRuleFilter(SqlRuleFilter):
    """Filter that matches no message (SQL ``1=0``)."""

    def __init__(self) -> None:
        super().__init__("1=0")

    def __repr__(self) -> str:
        return "FalseRuleFilter()"

    def evaluate(self, batch: Batch) -> pa.Array:
        """All false, without evaluating anything."""
        return constant(False, pa.bool_(), _as_table(batch).num_rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description."""
        return {"type": "FalseRuleFilter"}


# keyword -> system property column, in the SDK's argument order
_CORRELATION_FIELDS = {
    "correlation_id": "correlation_id",
    "message_id": "message_id",
    "to": "to",
    "reply_to": "reply_to",
    "label": "subject",
    "session_id": "session_id",
    "reply_to_session_id": "reply_to_session_id",
    "content_type": "content_type",
}


@dataclass(kw_only=True)
class CorrelationRuleFilter:
    """Exact-match filter on system fields and application properties, all ANDed (Service Bus CorrelationRuleFilter).

    Matching is case-sensitive on values and typed (``qty=5`` does not match ``"5"``; 5 equals 5.0);
    property names resolve like in SQL filters (exact spelling first, else case-insensitive).
    """

    correlation_id: str | None = None
    message_id: str | None = None
    to: str | None = None
    reply_to: str | None = None
    label: str | None = None
    session_id: str | None = None
    reply_to_session_id: str | None = None
    content_type: str | None = None
    properties: dict[str, Any] | None = None
    _tree: Node = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.properties = _as_dict(self.properties, "CorrelationRuleFilter.properties")
        conditions = self._field_conditions() + self._property_conditions()
        if not conditions:
            raise InvalidOperationError("CorrelationRuleFilter needs at least one field or property to match")
        self._tree = balanced(And, conditions)  # balanced: many properties never nest deeply

    def _field_conditions(self) -> list[Node]:
        """sys.<field> = value for each given system field."""
        conditions: list[Node] = []
        for name, column in _CORRELATION_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidOperationError(f"CorrelationRuleFilter.{name} must be a string, got {value!r}")
            conditions.append(Compare("=", SysProp(SYSTEM_PROPERTIES[column.replace("_", "")]), Const(value)))
        return conditions

    def _property_conditions(self) -> list[Node]:
        """user.<key> = value for each given application property."""
        conditions: list[Node] = []
        for key, value in (self.properties or {}).items():
            try:
                normalized = normalize_value(value)
            except (TypeError, ValueError) as exc:
                raise InvalidOperationError(f"CorrelationRuleFilter property {key!r}: {exc}") from exc
            if not isinstance(key, str) or normalized is None:
                raise InvalidOperationError(f"CorrelationRuleFilter property {key!r} needs a string key and a non-null value")
            conditions.append(Compare("=", UserProp(key), Const(normalized)))
        return conditions

    def evaluate(self, batch: Batch) -> pa.Array:
        """Boolean per message: do all given fields and properties match exactly?"""
        return _matches(self._tree, batch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description (only the given fields)."""
        data: dict[str, Any] = {"type": "CorrelationRuleFilter"}
        data.update({name: getattr(self, name) for name in _CORRELATION_FIELDS if getattr(self, name) is not None})
        if self.properties:
            data["properties"] = _encode_mapping(self.properties)
        return data


RuleFilter = SqlRuleFilter | CorrelationRuleFilter


@dataclass
class SqlRuleAction:
    """SQL rule action (``SET prop = expr; REMOVE prop``) applied to the messages a rule matched."""

    sql_expression: str
    parameters: dict[str, Any] | None = None
    _statements: tuple[Statement, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.parameters = _as_dict(self.parameters, f"{type(self).__name__}.parameters")
        self._statements = parse_action(self.sql_expression, self.parameters)

    def apply(self, batch: Batch, max_text_bytes: int | None = None) -> pa.Table:
        """A copy of the batch with the statements applied in order to every row.

        With `max_text_bytes`, a string join making a longer string raises ActionValueTooLargeError
        as soon as it is made: an action of 32 statements doubling a string could otherwise build
        gigabytes before the copy's size is checked.
        """
        ctx = _Context(_as_table(batch), max_text_bytes)
        for statement in self._statements:
            _execute(statement, ctx)
        return ctx.to_table()

    def system_properties(self) -> set[str]:
        """The Service Bus names of the sys properties the statements read or write."""
        return system_properties_read(self._statements)

    def sets(self, column: str) -> bool:
        """True when a SET statement writes the system property stored in ``column`` (e.g. ``"session_id"``)."""
        return any(
            isinstance(s, SetStatement) and isinstance(s.target, SysProp) and s.target.prop.column == column
            for s in self._statements
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description for the rule catalog (see ``action_from_dict``)."""
        return {
            "type": "SqlRuleAction",
            "sql_expression": self.sql_expression,
            "parameters": _encode_mapping(self.parameters),
        }


def _execute(statement: Statement, ctx: _Context) -> None:
    """Run one SET/REMOVE statement against the batch context."""
    target = statement.target
    value = _eval(statement.value, ctx) if isinstance(statement, SetStatement) else _Value.null(ctx.num_rows)
    if isinstance(target, SysProp):
        ctx.set_system(target.prop, value)
    elif isinstance(statement, SetStatement):
        ctx.set_user(target.name, value)
    else:
        ctx.remove_user(target.name)


def _require(data: Mapping[str, Any], key: str) -> Any:
    """A mandatory key of a stored description."""
    if key not in data:
        raise InvalidOperationError(f"rule description {dict(data)!r} lacks {key!r}")
    return data[key]


def filter_from_dict(data: Mapping[str, Any]) -> RuleFilter:
    """Rebuild a filter from ``to_dict`` output."""
    kind = _require(data, "type")
    if kind == "SqlRuleFilter":
        return SqlRuleFilter(_require(data, "sql_expression"), _decode_mapping(data.get("parameters")))
    if kind == "TrueRuleFilter":
        return TrueRuleFilter()
    if kind == "FalseRuleFilter":
        return FalseRuleFilter()
    if kind == "CorrelationRuleFilter":
        fields = {name: data.get(name) for name in _CORRELATION_FIELDS}
        return CorrelationRuleFilter(**fields, properties=_decode_mapping(data.get("properties")))
    raise InvalidOperationError(f"unknown rule filter type {kind!r}")


def action_from_dict(data: Mapping[str, Any]) -> SqlRuleAction:
    """Rebuild a rule action from ``to_dict`` output."""
    kind = _require(data, "type")
    if kind != "SqlRuleAction":
        raise InvalidOperationError(f"unknown rule action type {kind!r}")
    return SqlRuleAction(_require(data, "sql_expression"), _decode_mapping(data.get("parameters")))
