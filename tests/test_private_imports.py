"""No sparkqueue module reaches into another module's `_private` names (issue #17).

Walks every module's AST, relative imports included (`from ..receiver import _check_open`), and flags
`from x import _y` plus `x._y` attribute access on a module bound by `import x` / `from pkg import x`.
A private attribute read on anything but `self`/`cls`/`super()` (`receiver._check_open()`,
`self._ns._entry(...)`) is a reach unless the module itself defines that name (a class of the
module working with another instance, or with a helper of the same module, as `ReceiverSession`
with its `Receiver`): `_name` means private to its module.
Third-party privates sparkqueue must use are listed in THIRD_PARTY, each with its reason.
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


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names the module defines: functions, classes, class-level fields, and `self._x = ...` attributes."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    out.add(t.attr)
    return {n for n in out if _private(n)}


def reaches(path: Path, text: str | None = None) -> list[str]:
    """`module: target` strings for every private name of another module that the module at `path` uses."""
    me = ".".join(_module_of(path))
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text)
    own = defined_privates(tree)
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
        elif not _on_self(node.value) and node.attr not in own:
            out.append(f"{me}: <object>.{node.attr}")  # `receiver._check_open()`: a private of another module's object
    return sorted(set(out))


def _on_self(value: ast.expr) -> bool:
    """`self._x`, `cls._x` or `super()._x`: the class's own private."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


# Private names of Python and PySpark that have no public equivalent; nothing of sparkqueue's own belongs here.
THIRD_PARTY: dict[str, str] = {
    "sparkqueue.cli.app: <object>._exit": "os._exit: leave without running atexit hooks (a documented os function)",
    "sparkqueue.shutdown: <object>._current_frames": "sys._current_frames: the threads' stacks for a shutdown report",
    "sparkqueue.spark.datasource: <object>._jsparkSession": "PySpark has no public check for a registered source",
    "sparkqueue.spark.session: <object>._active_spark_context": "PySpark's only handle on a running SparkContext",
}


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = {r for path in sorted(PACKAGE.rglob("*.py")) for r in reaches(path)}
    assert not (found - set(THIRD_PARTY)), f"reaches into private names: {sorted(found - set(THIRD_PARTY))}"
    assert not (set(THIRD_PARTY) - found), f"gone, delete from THIRD_PARTY: {sorted(set(THIRD_PARTY) - found)}"


def test_the_check_tells_another_modules_private_from_the_modules_own() -> None:
    """The rule itself: another object's private is a reach; a private the module defines is not."""
    where = PACKAGE / "spark" / "probe.py"  # never written: only names the module the text stands for
    reach = "def f(receiver):\n    return receiver._check_open()\n"
    own = "class A:\n    def __init__(self):\n        self._x = 1\n\n\ndef f(a):\n    return a._x\n"
    imported = "from sparkqueue.receiver import _seqs\n"
    assert reaches(where, reach) == ["sparkqueue.spark.probe: <object>._check_open"]
    assert reaches(where, own) == []
    assert reaches(where, imported) == ["sparkqueue.spark.probe: sparkqueue.receiver._seqs"]
