"""Parser for the Service Bus SQL filter and rule-action language.

Turns the text of a ``SqlRuleFilter`` or ``SqlRuleAction`` into a small immutable syntax tree.
This module knows nothing about pyarrow: ``sparkqueue.model.filters`` compiles the tree into
vectorized pyarrow.compute calls.  Grammar (Service Bus subset of SQL-92, keywords and property
names case-insensitive)::

    condition  := or
    or         := and { OR and }
    and        := not { AND not }
    not        := NOT not | predicate
    predicate  := additive [ cmp additive | IS [NOT] NULL
                            | [NOT] IN ( additive {, additive} )
                            | [NOT] LIKE pattern [ESCAPE char] ]
    additive   := multiply { (+|-) multiply }
    multiply   := unary { (*|/|%) unary }
    unary      := (+|-) unary | primary
    primary    := constant | @parameter | property | function ( args ) | EXISTS ( property )
                | ( condition )
    property   := [sys. | user.] name        (name: identifier, [delimited], or double-quoted)
    statements := statement { [;] statement } [;]       (rule actions)
    statement  := SET property = condition | REMOVE property

Error positions in messages are 1-based character offsets into the expression text.

Static kinds (``Node.kind``) refuse what could never work: arithmetic on a time other than C#'s
time - time (a duration) and time +/- duration (durations are milliseconds, as ``sys.TimeToLive``
and timedelta parameters), and a SET of a system property to a value of a kind it cannot hold.

Bounds (Service Bus's own where it has them): an expression is at most 1,024 characters and an
action at most 32 statements; parentheses, NOT and signs nest at most 32 deep, and the finished
tree at most 64 levels (chains of AND / OR are built balanced, so long chains stay shallow). So
neither parsing nor evaluation can exhaust the interpreter's recursion limit; what exceeds a bound
is a FilterSyntaxError when the rule is created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import uuid
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar

from sparkqueue.errors import FilterSyntaxError

__all__ = [
    "SYSTEM_PROPERTIES",
    "And",
    "Arith",
    "Compare",
    "Const",
    "Exists",
    "InList",
    "IsNull",
    "Like",
    "NewId",
    "Node",
    "Not",
    "Or",
    "RemoveStatement",
    "SetStatement",
    "Statement",
    "SysProp",
    "SystemProperty",
    "Token",
    "Unary",
    "UserProp",
    "normalize_value",
    "parse_action",
    "parse_condition",
    "balanced",
    "tokenize",
    "tree_depth",
]

MAX_EXPRESSION_LENGTH = 1024  # Service Bus: SQL filter and rule action text, in characters
MAX_ACTION_STATEMENTS = 32  # Service Bus: expressions per rule action
MAX_NESTING = 32  # parentheses, NOT and unary signs nested in one another
MAX_TREE_DEPTH = 64  # levels of the parsed tree (evaluation recurses once per level)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
KEYWORDS = frozenset({"AND", "OR", "NOT", "IS", "NULL", "IN", "LIKE", "ESCAPE", "EXISTS", "TRUE", "FALSE"})
COMPARISONS = frozenset({"=", "<>", "!=", ">", ">=", "<", "<="})
_TWO_CHAR_OPS = frozenset({"<>", "!=", ">=", "<="})
_ONE_CHAR_OPS = frozenset("(),.;=<>+-*/%")
_CONDITION_KINDS = frozenset({"bool", "any", "null"})


# --------------------------------------------------------------------------- system properties


@dataclass(frozen=True)
class SystemProperty:
    """A ``sys.<Name>`` property: its Service Bus name, batch column, value kind and writability."""

    name: str
    column: str
    kind: str
    settable: bool


_SYSTEM_LIST = (
    SystemProperty("MessageId", "message_id", "string", True),
    SystemProperty("CorrelationId", "correlation_id", "string", True),
    SystemProperty("To", "to", "string", True),
    SystemProperty("ReplyTo", "reply_to", "string", True),
    SystemProperty("Label", "subject", "string", True),
    SystemProperty("SessionId", "session_id", "string", True),
    SystemProperty("ReplyToSessionId", "reply_to_session_id", "string", True),
    SystemProperty("ContentType", "content_type", "string", True),
    SystemProperty("PartitionKey", "partition_key", "string", True),
    SystemProperty("SequenceNumber", "sequence_number", "number", False),
    SystemProperty("EnqueuedTimeUtc", "enqueued_time_utc", "time", False),
    SystemProperty("ExpiresAtUtc", "expires_at_utc", "time", False),
    SystemProperty("ScheduledEnqueueTimeUtc", "scheduled_enqueue_time_utc", "time", True),
    SystemProperty("DeliveryCount", "delivery_count", "number", False),
    SystemProperty("Size", "size_in_bytes", "number", False),
    SystemProperty("TimeToLive", "time_to_live_ms", "number", True),
)


def _system_key(name: str) -> str:
    """Normalize a system property spelling: case-insensitive, underscores ignored (reply_to == ReplyTo)."""
    return name.replace("_", "").lower()


def _build_system_index() -> dict[str, SystemProperty]:
    """Map every accepted spelling (Service Bus name, column name, Subject alias) to its property."""
    index: dict[str, SystemProperty] = {}
    for prop in _SYSTEM_LIST:
        index[_system_key(prop.name)] = prop
        index[_system_key(prop.column)] = prop
    return index


SYSTEM_PROPERTIES: Mapping[str, SystemProperty] = _build_system_index()


# --------------------------------------------------------------------------- syntax tree


class Node:
    """Base class of expression nodes; ``kind`` is the statically known value kind (or 'any')."""

    kind: ClassVar[str] = "any"


@dataclass(frozen=True)
class Const(Node):
    """A literal or a bound @parameter: str, int, float, bool, None or an aware UTC datetime."""

    value: object

    @property
    def kind(self) -> str:  # type: ignore[override]
        """Kind of the constant's Python value."""
        return _kind_of_value(self.value)


@dataclass(frozen=True)
class SysProp(Node):
    """Reference to a system property column."""

    prop: SystemProperty

    @property
    def kind(self) -> str:  # type: ignore[override]
        """Kind of the system property's column."""
        return self.prop.kind


@dataclass(frozen=True)
class UserProp(Node):
    """Reference to an application property by name (resolved per row, exact match first)."""

    name: str


@dataclass(frozen=True)
class NewId(Node):
    """``newid()``: a fresh random GUID string per row."""

    kind: ClassVar[str] = "string"


@dataclass(frozen=True)
class Unary(Node):
    """Unary ``+`` or ``-``."""

    op: str
    operand: Node
    kind: ClassVar[str] = "number"


@dataclass(frozen=True)
class Arith(Node):
    """Binary arithmetic ``+ - * / %`` (``+`` also concatenates two strings)."""

    op: str
    left: Node
    right: Node

    @property
    def kind(self) -> str:  # type: ignore[override]
        """Result kind under C# binding: string + string, time - time (a duration), time ± duration, else number."""
        return _arith_kind(self.op, self.left.kind, self.right.kind)


def _arith_kind(op: str, left: str, right: str) -> str:
    """Kind of ``left op right``; durations are numbers of milliseconds, as ``sys.TimeToLive`` and timedelta parameters.

    ``+`` of a string and a string or number joins them, as evaluation does (filters._plain_arith).
    """
    if op == "+" and "string" in (left, right) and {left, right} <= {"string", "number"}:
        return "string"
    if left == "time" and op in ("+", "-"):
        return "number" if right == "time" else "time"
    return "number"


def _time_arith_allowed(op: str, left: str, right: str) -> bool:
    """Whether an operator may take these operand kinds when one is a time: time - time, time + or - a duration."""
    if "time" not in (left, right):
        return True
    durations = ("number", "any", "null")
    return left == "time" and ((op == "-" and right in (*durations, "time")) or (op == "+" and right in durations))


@dataclass(frozen=True)
class Compare(Node):
    """Binary comparison ``= <> != > >= < <=``."""

    op: str
    left: Node
    right: Node
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class And(Node):
    """Three-valued logical AND."""

    left: Node
    right: Node
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class Or(Node):
    """Three-valued logical OR."""

    left: Node
    right: Node
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class Not(Node):
    """Three-valued logical NOT."""

    operand: Node
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class IsNull(Node):
    """``x IS [NOT] NULL``: never unknown."""

    operand: Node
    negated: bool
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class InList(Node):
    """``x [NOT] IN (a, b, ...)``."""

    operand: Node
    items: tuple[Node, ...]
    negated: bool
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class Like(Node):
    """``x [NOT] LIKE pattern``; ``pattern`` is already in pyarrow ``match_like`` syntax (backslash escapes)."""

    operand: Node
    pattern: str
    negated: bool
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class Exists(Node):
    """``EXISTS(prop)``: the application property key is present (system property: is not null)."""

    prop: SysProp | UserProp
    kind: ClassVar[str] = "bool"


@dataclass(frozen=True)
class SetStatement:
    """Rule action ``SET target = value``."""

    target: SysProp | UserProp
    value: Node


@dataclass(frozen=True)
class RemoveStatement:
    """Rule action ``REMOVE target``."""

    target: SysProp | UserProp


Statement = SetStatement | RemoveStatement


def system_properties_read(*roots: object) -> set[str]:
    """The Service Bus names of the sys properties a parsed condition or action reads (a walk of its dataclass tree)."""
    found: set[str] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if isinstance(node, SysProp):
            found.add(node.prop.name)
        elif isinstance(node, (tuple, list)):
            todo.extend(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            todo.extend(getattr(node, f.name) for f in dataclasses.fields(node))
    return found


# --------------------------------------------------------------------------- values and parameters


def _kind_of_value(value: object) -> str:
    """Static kind of a normalized constant."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dt.datetime):
        return "time"
    return "string"


def normalize_value(value: object) -> object:
    """Convert a parameter/property value to the engine's domain; TypeError/ValueError if unsupported (or not finite).

    Datetimes become aware UTC (naive ones are taken as UTC), timedeltas become milliseconds
    (like ``sys.TimeToLive``) and UUIDs become strings.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number (NaN and infinities cannot be stored as JSON)")
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"integer {value} is outside the 64-bit range")
        return value
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
        try:
            return aware.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError(f"datetime {value} is outside the range of UTC times") from None
    if isinstance(value, dt.timedelta):
        millis = value / dt.timedelta(milliseconds=1)
        return int(millis) if millis.is_integer() else millis
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"unsupported value type {type(value).__name__}")


def _bind_parameters(source: str, parameters: Mapping[str, object] | None) -> dict[str, object]:
    """Index parameters by lower-case name without the leading '@' and normalize their values."""
    bound: dict[str, object] = {}
    for name, value in (parameters or {}).items():
        if not isinstance(name, str) or not name.lstrip("@"):
            raise FilterSyntaxError(f"parameter names must be non-empty strings, got {name!r}")
        try:
            bound[name.lstrip("@").lower()] = normalize_value(value)
        except (TypeError, ValueError) as exc:
            raise FilterSyntaxError(f"parameter {name!r}: {exc} in SQL expression {source!r}") from exc
    return bound


# --------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class Token:
    """One lexical token: kind, source text, decoded value and 0-based offset."""

    kind: str  # int | float | string | ident | quoted | param | op | eof
    text: str
    value: object
    pos: int

    def describe(self) -> str:
        """Human description used in error messages."""
        if self.kind == "eof":
            return "end of expression"
        if self.kind == "string":
            return f"string {self.text}"
        return f"'{self.text}'"

    def is_keyword(self, *words: str) -> bool:
        """True for an unquoted identifier spelling one of ``words`` (case-insensitive)."""
        return self.kind == "ident" and str(self.value).upper() in words

    def is_op(self, *ops: str) -> bool:
        """True for an operator/punctuation token among ``ops``."""
        return self.kind == "op" and self.text in ops


def _syntax_error(source: str, pos: int, message: str) -> FilterSyntaxError:
    """Build a FilterSyntaxError naming the 1-based position and the expression."""
    return FilterSyntaxError(f"{message} at position {pos + 1} in SQL expression {source!r}")


class _Lexer:
    """Splits an expression into tokens; raises FilterSyntaxError on malformed text."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.pos = 0

    def tokens(self) -> list[Token]:
        """All tokens of the source, ending with an 'eof' token."""
        result: list[Token] = []
        while True:
            self._skip_space()
            if self.pos >= len(self.source):
                result.append(Token("eof", "", None, self.pos))
                return result
            result.append(self._next())

    def _skip_space(self) -> None:
        while self.pos < len(self.source) and self.source[self.pos].isspace():
            self.pos += 1

    def _peek(self, offset: int = 0) -> str:
        index = self.pos + offset
        return self.source[index] if index < len(self.source) else ""

    def _next(self) -> Token:
        char = self._peek()
        if char.isdigit() or (char == "." and self._peek(1).isdigit()):
            return self._number()
        if char == "'":
            return self._quoted("'", "string", "string constant")
        if char == "[":
            return self._quoted("]", "quoted", "delimited identifier")
        if char == '"':
            return self._quoted('"', "quoted", "quoted identifier")
        if char == "@":
            return self._parameter()
        if char.isalpha() or char == "_":
            start = self.pos
            text = self._word()
            return Token("ident", text, text, start)
        return self._operator()

    def _word(self) -> str:
        start = self.pos
        while self._peek() and (self._peek().isalnum() or self._peek() == "_"):
            self.pos += 1
        return self.source[start : self.pos]

    def _digits(self) -> None:
        while self._peek().isdigit():
            self.pos += 1

    def _number(self) -> Token:
        start = self.pos
        self._digits()
        is_float = False
        if self._peek() == ".":  # 1.5, .5 and 5. are decimal constants ("contain a decimal point")
            is_float = True
            self.pos += 1
            self._digits()
        if self._peek() in ("e", "E"):
            is_float = True
            self.pos += 1
            if self._peek() in ("+", "-"):
                self.pos += 1
            if not self._peek().isdigit():
                raise _syntax_error(self.source, self.pos, "expected digits in the exponent of the number")
            self._digits()
        if self._peek().isalpha() or self._peek() == "_":
            raise _syntax_error(self.source, start, f"invalid number '{self.source[start : self.pos + 1]}'")
        text = self.source[start : self.pos]
        if not text.isascii():
            raise _syntax_error(self.source, start, f"invalid number '{text}'")
        return Token("float" if is_float else "int", text, float(text) if is_float else int(text), start)

    def _quoted(self, close: str, kind: str, what: str) -> Token:
        """Scan '...', [...] or "..." where the closing character is escaped by doubling it."""
        start = self.pos
        self.pos += 1
        parts: list[str] = []
        while True:
            index = self.source.find(close, self.pos)
            if index < 0:
                raise _syntax_error(self.source, start, f"unterminated {what} (missing closing {close})")
            parts.append(self.source[self.pos : index])
            self.pos = index + 1
            if self._peek() != close:
                break
            parts.append(close)
            self.pos += 1
        value = "".join(parts)
        if kind == "quoted" and not value:
            raise _syntax_error(self.source, start, f"empty {what}")
        return Token(kind, self.source[start : self.pos], value, start)

    def _parameter(self) -> Token:
        start = self.pos
        self.pos += 1
        if not (self._peek().isalpha() or self._peek() == "_"):
            raise _syntax_error(self.source, start, "expected a parameter name after '@'")
        name = self._word()
        return Token("param", "@" + name, name, start)

    def _operator(self) -> Token:
        start = self.pos
        pair = self.source[start : start + 2]
        if pair == "==":
            raise _syntax_error(self.source, start, "unknown operator '==' (use '=' for equality)")
        if pair in _TWO_CHAR_OPS:
            self.pos += 2
            return Token("op", pair, pair, start)
        char = self.source[start]
        if char in _ONE_CHAR_OPS:
            self.pos += 1
            return Token("op", char, char, start)
        hint = " (use '!=' or '<>' for inequality, NOT for negation)" if char == "!" else ""
        raise _syntax_error(self.source, start, f"unknown operator or character '{char}'{hint}")


def tokenize(source: str) -> list[Token]:
    """Split SQL filter/action text into tokens (last one has kind 'eof')."""
    return _Lexer(source).tokens()


# --------------------------------------------------------------------------- parser


# Set while rules the catalog holds are parsed again (stored_rules): see there.
_STORED: ContextVar[bool] = ContextVar("sparkqueue_stored_rules", default=False)


@contextlib.contextmanager
def stored_rules() -> Iterator[None]:
    """Parse rules as the catalog holds them: without the kind checks a new rule gets (time arithmetic, SET types).

    A rule stored before a check existed keeps working as it did (an expression no check allows
    evaluates to NULL, and a SET of a value the property cannot hold raises per message, which
    dead-letters that copy), instead of failing every send to its topic (docs/semantics.md §8).
    """
    token = _STORED.set(True)
    try:
        yield
    finally:
        _STORED.reset(token)


class _Parser:
    """Recursive-descent parser over the token list; one instance per expression."""

    def __init__(self, source: str, parameters: Mapping[str, object] | None) -> None:
        if not isinstance(source, str):
            raise FilterSyntaxError(f"SQL expression must be a string, got {type(source).__name__}")
        if len(source) > MAX_EXPRESSION_LENGTH:
            raise FilterSyntaxError(
                f"SQL expression is {len(source)} characters long; at most {MAX_EXPRESSION_LENGTH} are allowed"
            )
        self.source = source
        self.strict = not _STORED.get()  # kind checks: for rules being made, not for rules the catalog holds
        self.params = _bind_parameters(source, parameters)
        self.tokens = tokenize(source)
        self.index = 0
        self.nesting = 0

    def nest(self, token: Token) -> None:
        """Enter one nesting level (parenthesis, NOT, sign); FilterSyntaxError beyond MAX_NESTING."""
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise self.error(f"expression nests more than {MAX_NESTING} levels deep", token)

    # -- token helpers

    @property
    def tok(self) -> Token:
        """Current token."""
        return self.tokens[self.index]

    def peek(self) -> Token:
        """Token after the current one."""
        return self.tokens[min(self.index + 1, len(self.tokens) - 1)]

    def advance(self) -> Token:
        """Consume and return the current token."""
        token = self.tok
        if token.kind != "eof":
            self.index += 1
        return token

    def error(self, message: str, token: Token | None = None) -> FilterSyntaxError:
        """FilterSyntaxError located at ``token`` (default: the current token)."""
        return _syntax_error(self.source, (token or self.tok).pos, message)

    def expected(self, what: str) -> FilterSyntaxError:
        """Error 'expected X but found Y' at the current token."""
        return self.error(f"expected {what} but found {self.tok.describe()}")

    def expect_op(self, op: str, context: str = "") -> Token:
        """Consume operator ``op`` or raise."""
        if not self.tok.is_op(op):
            raise self.expected(f"'{op}'{context}")
        return self.advance()

    def accept_keyword(self, word: str) -> bool:
        """Consume keyword ``word`` if present."""
        if self.tok.is_keyword(word):
            self.advance()
            return True
        return False

    def expect_end(self) -> None:
        """Raise on trailing tokens after a complete expression."""
        if self.tok.kind != "eof":
            raise self.error(f"unexpected {self.tok.describe()} after the end of the expression")

    # -- static checks

    def require_condition(self, node: Node, token: Token) -> Node:
        """Reject operands of AND/OR/NOT (or whole filters) that can never be boolean."""
        if node.kind not in _CONDITION_KINDS:
            raise self.error(
                f"expected a condition (comparison, IN, LIKE, IS NULL, EXISTS, TRUE/FALSE) but found a {node.kind} expression",
                token,
            )
        return node

    def require_value(self, node: Node, token: Token, op: str) -> Node:
        """Reject conditions used as arithmetic operands."""
        if node.kind == "bool":
            raise self.error(f"operator '{op}' needs a value, not a condition", token)
        return node

    # -- grammar

    def condition(self) -> Node:
        """or := and { OR and } (built as a balanced tree: OR is associative)."""
        start = self.tok
        nodes = [self.and_()]
        while self.tok.is_keyword("OR"):
            self.require_condition(nodes[-1], start)
            self.advance()
            start = self.tok
            nodes.append(self.require_condition(self.and_(), start))
        return balanced(Or, nodes)

    def and_(self) -> Node:
        """and := not { AND not } (built as a balanced tree: AND is associative)."""
        start = self.tok
        nodes = [self.not_()]
        while self.tok.is_keyword("AND"):
            self.require_condition(nodes[-1], start)
            self.advance()
            start = self.tok
            nodes.append(self.require_condition(self.not_(), start))
        return balanced(And, nodes)

    def not_(self) -> Node:
        """not := NOT not | predicate."""
        token = self.tok
        if self.accept_keyword("NOT"):
            self.nest(token)
            start = self.tok
            node = Not(self.require_condition(self.not_(), start))
            self.nesting -= 1
            return node
        return self.predicate()

    def predicate(self) -> Node:
        """A value optionally followed by a comparison, IS NULL, IN or LIKE."""
        left = self.additive()
        token = self.tok
        if token.kind == "op" and token.text in COMPARISONS:
            self.advance()
            return Compare("<>" if token.text == "!=" else token.text, left, self.additive())
        if self.accept_keyword("IS"):
            negated = self.accept_keyword("NOT")
            if not self.accept_keyword("NULL"):
                raise self.expected("NULL after IS" + (" NOT" if negated else ""))
            return IsNull(left, negated)
        negated = False
        if token.is_keyword("NOT"):
            self.advance()
            negated = True
            if not self.tok.is_keyword("IN", "LIKE"):
                raise self.expected("IN or LIKE after NOT")
        if self.accept_keyword("IN"):
            return InList(left, self.in_items(), negated)
        if self.accept_keyword("LIKE"):
            return self.like(left, negated)
        return left

    def in_items(self) -> tuple[Node, ...]:
        """( value {, value} ) after IN."""
        self.expect_op("(", " after IN")
        items = [self.additive()]
        while self.tok.is_op(","):
            self.advance()
            items.append(self.additive())
        self.expect_op(")", " or ',' to continue the IN list")
        return tuple(items)

    def like(self, operand: Node, negated: bool) -> Like:
        """pattern [ESCAPE char] after LIKE, translated to pyarrow match_like syntax."""
        pattern_token = self.tok
        pattern = self.string_constant("a string pattern after LIKE")
        escape: str | None = None
        if self.accept_keyword("ESCAPE"):
            escape_token = self.tok
            escape = self.string_constant("a one-character string after ESCAPE")
            if len(escape) != 1:
                raise self.error(f"ESCAPE needs exactly one character, got {escape!r}", escape_token)
        return Like(operand, self.translate_like(pattern, escape, pattern_token), negated)

    def string_constant(self, what: str) -> str:
        """A string literal or string @parameter (optionally parenthesised)."""
        token = self.tok
        if token.kind == "eof":
            raise self.expected(what)
        node = self.unary()
        if not (isinstance(node, Const) and isinstance(node.value, str)):
            raise self.error(f"expected {what} (string constant or parameter)", token)
        return node.value

    def translate_like(self, pattern: str, escape: str | None, token: Token) -> str:
        """Rewrite a LIKE pattern with a custom escape character into backslash-escaped form."""
        out: list[str] = []
        index = 0
        while index < len(pattern):
            char = pattern[index]
            if char == escape:
                if index + 1 >= len(pattern):
                    raise self.error(f"LIKE pattern {pattern!r} ends with the escape character {escape!r}", token)
                out.append(_like_literal(pattern[index + 1]))
                index += 2
                continue
            out.append(char if char in "%_" else _like_literal(char))
            index += 1
        return "".join(out)

    def additive(self) -> Node:
        """additive := multiply { (+|-) multiply }."""
        start = self.tok
        node = self.multiply()
        while self.tok.is_op("+", "-"):
            op_token = self.advance()
            self.require_value(node, start, op_token.text)
            start = self.tok
            node = self.arith(op_token, node, self.require_value(self.multiply(), start, op_token.text))
        return node

    def multiply(self) -> Node:
        """multiply := unary { (*|/|%) unary }."""
        start = self.tok
        node = self.unary()
        while self.tok.is_op("*", "/", "%"):
            op_token = self.advance()
            self.require_value(node, start, op_token.text)
            start = self.tok
            node = self.arith(op_token, node, self.require_value(self.unary(), start, op_token.text))
        return node

    def arith(self, op_token: Token, left: Node, right: Node) -> Arith:
        """``left op right``; a time takes only ``- time`` and ``+``/``-`` a duration (C# DateTime and TimeSpan)."""
        op = op_token.text
        if self.strict and not _time_arith_allowed(op, left.kind, right.kind):
            raise self.error(
                f"operator '{op}' cannot take a {left.kind} and a {right.kind}: a time takes '-' a time "
                "(giving a duration in milliseconds) or '+'/'-' a duration in milliseconds (a number or timedelta)",
                op_token,
            )
        return Arith(op, left, right)

    def unary(self) -> Node:
        """unary := (+|-) unary | primary; '-' before a number literal folds into the constant."""
        if not self.tok.is_op("+", "-"):
            return self.primary()
        op_token = self.advance()
        if op_token.text == "-" and self.tok.kind in ("int", "float"):
            return self.number(self.advance(), negate=True)
        self.nest(op_token)
        start = self.tok
        operand = self.require_value(self.unary(), start, op_token.text)
        if self.strict and operand.kind == "time":
            raise self.error(f"sign '{op_token.text}' needs a number, not a time", op_token)
        node = Unary(op_token.text, operand)
        self.nesting -= 1
        return node

    def number(self, token: Token, negate: bool = False) -> Const:
        """Numeric literal; integers must fit in 64 bits like Service Bus longs."""
        value = token.value
        assert isinstance(value, int | float)
        value = -value if negate else value
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise self.error(f"integer constant {token.text} is outside the 64-bit range", token)
        return Const(value)

    def primary(self) -> Node:
        """Constant, parameter, property, function call, EXISTS(...) or parenthesised condition."""
        token = self.tok
        if token.kind in ("int", "float"):
            return self.number(self.advance())
        if token.kind == "string":
            return Const(self.advance().value)
        if token.kind == "param":
            return self.parameter(self.advance())
        if token.is_op("("):
            self.advance()
            self.nest(token)
            node = self.condition()
            self.expect_op(")", " to close the '(' at position " + str(token.pos + 1))
            self.nesting -= 1
            return node
        if token.kind == "ident" and str(token.value).upper() in KEYWORDS:
            return self.keyword_primary()
        if token.kind == "ident" and self.peek().is_op("("):
            return self.function()
        if token.kind in ("ident", "quoted"):
            return self.property_ref()
        raise self.expected("a value (constant, property, @parameter, function or '(')")

    def keyword_primary(self) -> Node:
        """TRUE, FALSE, NULL or EXISTS(prop); any other keyword is misplaced."""
        token = self.advance()
        word = str(token.value).upper()
        if word in ("TRUE", "FALSE"):
            return Const(word == "TRUE")
        if word == "NULL":
            return Const(None)
        if word == "EXISTS":
            self.expect_op("(", " after EXISTS")
            prop = self.property_ref()
            self.expect_op(")", " to close EXISTS(")
            return Exists(prop)
        raise self.error(f"expected a value but found keyword {word}", token)

    def parameter(self, token: Token) -> Const:
        """Substitute a bound @parameter."""
        key = str(token.value).lower()
        if key not in self.params:
            raise self.error(f"parameter {token.text} has no value (pass it in parameters=)", token)
        return Const(self.params[key])

    def function(self) -> Node:
        """newid(), property(name) or p(name)."""
        name_token = self.advance()
        name = str(name_token.value).lower()
        self.expect_op("(", f" after {name_token.text}")
        if name == "newid":
            self.expect_op(")", " (newid takes no arguments)")
            return NewId()
        if name in ("property", "p"):
            prop_name = self.string_constant(f"a property name string in {name_token.text}()")
            self.expect_op(")", f" to close {name_token.text}(")
            return UserProp(prop_name)
        raise self.error(f"unknown function '{name_token.text}' (supported: newid, property, p)", name_token)

    def property_ref(self) -> SysProp | UserProp:
        """[sys.|user.]name with regular, [delimited] or "quoted" names."""
        token = self.tok
        if token.kind not in ("ident", "quoted") or (token.kind == "ident" and token.is_keyword(*KEYWORDS)):
            raise self.expected("a property name")
        self.advance()
        if not self.tok.is_op("."):
            return UserProp(str(token.value))
        scope = str(token.value).lower() if token.kind == "ident" else ""
        if scope not in ("sys", "user"):
            raise self.error(f"unknown property scope {token.describe()} (use sys. or user.)", token)
        self.advance()
        name_token = self.tok
        if name_token.kind not in ("ident", "quoted"):
            raise self.expected(f"a property name after '{token.text}.'")
        self.advance()
        if scope == "user":
            return UserProp(str(name_token.value))
        return self.system_property(name_token)

    def system_property(self, token: Token) -> SysProp:
        """Resolve a sys.<Name>; an unknown system property is an error, as in Service Bus."""
        prop = SYSTEM_PROPERTIES.get(_system_key(str(token.value)))
        if prop is None:
            known = ", ".join(p.name for p in _SYSTEM_LIST)
            raise self.error(f"unknown system property sys.{token.value} (known: {known})", token)
        return SysProp(prop)

    # -- rule actions

    def statements(self) -> tuple[Statement, ...]:
        """statements := statement { [;] statement } [;]."""
        result = [self.statement()]
        while True:
            while self.tok.is_op(";"):
                self.advance()
            if self.tok.kind == "eof":
                return tuple(result)
            if len(result) >= MAX_ACTION_STATEMENTS:
                raise self.error(f"a rule action holds at most {MAX_ACTION_STATEMENTS} statements")
            result.append(self.statement())

    def statement(self) -> Statement:
        """SET property = value | REMOVE property."""
        token = self.tok
        if token.is_keyword("SET"):
            self.advance()
            target = self.writable_target()
            self.expect_op("=", f" after SET {target_name(target)}")
            value_token = self.tok
            value = self.condition()
            if isinstance(target, SysProp):
                self.check_settable(target.prop, value, value_token)
            return SetStatement(target, value)
        if token.is_keyword("REMOVE"):
            self.advance()
            return RemoveStatement(self.writable_target())
        raise self.expected("SET or REMOVE")

    def check_settable(self, prop: SystemProperty, value: Node, token: Token) -> None:
        """Refuse a SET whose value's static kind the property cannot hold (it would be stored as null).

        A value of unknown kind ('any': application properties) is checked per message when the action runs.
        """
        if not self.strict or value.kind == "any" or value.kind in _SETTABLE_FROM[prop.kind]:
            return
        what = f"the {value.kind} {value.value!r}" if isinstance(value, Const) else f"a {value.kind} expression"
        raise self.error(f"sys.{prop.name} takes a {prop.kind} value, not {what}", token)

    def writable_target(self) -> SysProp | UserProp:
        """A property an action may change; read-only system properties are rejected."""
        token = self.tok
        target = self.property_ref()
        if isinstance(target, SysProp) and not target.prop.settable:
            raise self.error(f"system property sys.{target.prop.name} is read-only", token)
        return target


# The value kinds a SET of a system property's kind accepts (filters._coerce converts them; others would store null).
_SETTABLE_FROM = {"string": ("string", "number", "bool", "time", "null"), "number": ("number", "null"), "time": ("time", "null")}


def _like_literal(char: str) -> str:
    """Escape a character so pyarrow's match_like treats it literally."""
    return "\\" + char if char in "%_\\" else char


def target_name(target: SysProp | UserProp) -> str:
    """SQL spelling of an action target, for messages."""
    return f"sys.{target.prop.name}" if isinstance(target, SysProp) else target.name


def balanced(op: type[And] | type[Or], nodes: list[Node]) -> Node:
    """Combine nodes with an associative operator as a balanced tree (depth log2 n, not n), iteratively."""
    while len(nodes) > 1:
        paired = [op(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
        nodes = paired + ([nodes[-1]] if len(nodes) % 2 else [])
    return nodes[0]


def tree_depth(root: object) -> int:
    """Levels of a syntax tree (or statement), counted without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        for name in getattr(node, "__dataclass_fields__", {}):
            child = getattr(node, name)
            children = child if isinstance(child, tuple) else (child,)
            stack.extend((c, depth + 1) for c in children if isinstance(c, (Node, SetStatement, RemoveStatement)))
    return deepest


def _check_depth(source: str, root: object) -> None:
    depth = tree_depth(root)
    if depth > MAX_TREE_DEPTH:
        raise FilterSyntaxError(
            f"SQL expression {source!r} is {depth} levels deep; at most {MAX_TREE_DEPTH} are allowed "
            "(long chains of arithmetic nest one level per operator)"
        )


def parse_condition(source: str, parameters: Mapping[str, object] | None = None) -> Node:
    """Parse a SQL filter expression into a syntax tree; FilterSyntaxError if it is invalid or too large."""
    parser = _Parser(source, parameters)
    if parser.tok.kind == "eof":
        raise parser.error("empty SQL filter: expected a condition such as sys.Label = 'x'")
    start = parser.tok
    node = parser.condition()
    parser.expect_end()
    node = parser.require_condition(node, start)
    _check_depth(source, node)
    return node


def parse_action(source: str, parameters: Mapping[str, object] | None = None) -> tuple[Statement, ...]:
    """Parse a SQL rule action (SET/REMOVE statements); FilterSyntaxError if it is invalid or too large."""
    parser = _Parser(source, parameters)
    if parser.tok.kind == "eof":
        raise parser.error("empty SQL action: expected SET or REMOVE")
    statements = parser.statements()
    for statement in statements:
        _check_depth(source, statement)
    return statements
