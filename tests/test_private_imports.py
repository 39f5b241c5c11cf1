"""No sparkqueue module reaches into another module's `_private` names (issue #17).

Walks every module's AST, relative imports included (`from ..receiver import _check_open`), and flags
`from x import _y` plus `x._y` attribute access on a module bound by `import x` / `from pkg import x`.
Private attributes read on anything but `self`/`cls`/`super()` (`receiver._check_open()`,
`self._ns._entry(...)`) are listed as `<object>._name` per module: that also counts a class touching
another instance of itself, which is why it is a ratchet and not yet a hard zero.
The existing reaches are listed in KNOWN, one string each, so the count can only go down: a new one
fails this test, and a removed one must be deleted from KNOWN (the test fails on stale entries too).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sparkqueue"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def reaches(path: Path) -> list[str]:
    """`module: target` strings for every private name of another sparkqueue module used by this one."""
    me = ".".join(_module_of(path))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(path, node)
            if not source.startswith("sparkqueue") or source == me:
                continue
            for alias in node.names:
                if _private(alias.name):
                    out.append(f"{me}: {source}.{alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sparkqueue") and alias.name != me:
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            out.append(f"{me}: {modules[node.value.id]}.{node.attr}")
        elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and not (
            isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"
        ):
            # `receiver._check_open()`, `self._ns._entry(...)`: a private of some other object
            out.append(f"{me}: <object>.{node.attr}")
    return sorted(set(out))


KNOWN: set[str] = {
    "sparkqueue.auto_lock_renewer: <object>._closed",
    "sparkqueue.auto_lock_renewer: <object>._lock_expired",
    "sparkqueue.cli.app: <object>._exit",
    "sparkqueue.message: <object>._correlation_id",
    "sparkqueue.message: <object>._message_id",
    "sparkqueue.message: <object>._partition_key",
    "sparkqueue.message: <object>._session_id",
    "sparkqueue.model.sessions: <object>._mine",
    "sparkqueue.receiver: <object>._active_transaction",
    "sparkqueue.receiver: <object>._guard",
    "sparkqueue.receiver: <object>._lock",
    "sparkqueue.receiver: <object>._lock_expired",
    "sparkqueue.receiver: <object>._mine",
    "sparkqueue.receiver: <object>._release",
    "sparkqueue.receiver: <object>._rewind",
    "sparkqueue.receiver: <object>._sessions",
    "sparkqueue.receiver: <object>._settled",
    "sparkqueue.receiver: <object>._track",
    "sparkqueue.sender: <object>._active_transaction",
    "sparkqueue.shutdown: <object>._current_frames",
    "sparkqueue.spark.datasource: <object>._entry",
    "sparkqueue.spark.datasource: <object>._getframe",
    "sparkqueue.spark.datasource: <object>._jsparkSession",  # PySpark has no public check for a registered source
    "sparkqueue.spark.receive: <object>._active_transaction",
    "sparkqueue.spark.receive: <object>._check_open",
    "sparkqueue.spark.receive: <object>._deleting",
    "sparkqueue.spark.receive: <object>._entity",
    "sparkqueue.spark.receive: <object>._ns",
    "sparkqueue.spark.receive: <object>._sub_queue",
    "sparkqueue.spark.send: <object>._active_transaction",
    "sparkqueue.spark.send: <object>._ns",
    "sparkqueue.spark.session: <object>._active_spark_context",
    "sparkqueue.spark.settle: <object>._entity",
    "sparkqueue.spark.settle: <object>._ns",
    "sparkqueue.spark.streaming: <object>._entry",
    "sparkqueue.storage.index: <object>._actions",
    "sparkqueue.storage.index: <object>._files",
    "sparkqueue.transaction: <object>._active_transaction",
    "sparkqueue.transaction: <object>._local",
}


def test_no_new_private_reaches() -> None:
    found = {r for path in sorted(PACKAGE.rglob("*.py")) for r in reaches(path)}
    assert not (found - KNOWN), f"new reaches into private names: {sorted(found - KNOWN)}"
    assert not (KNOWN - found), f"gone, delete from KNOWN: {sorted(KNOWN - found)}"
