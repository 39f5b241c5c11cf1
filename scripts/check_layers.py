"""Enforce the import layers of sparkqueue (README "Architecture"): imports flow downward only.

- `sparkqueue.storage` (the Delta storage, bottom) imports only itself and `sparkqueue.errors`;
- `sparkqueue.model` (entity rules, middle) imports only itself, storage, errors and constants;
- no module imports a `_private` name from another sparkqueue module.
Exits 1 listing every violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sparkqueue"
ALLOWED = {
    "sparkqueue.storage": ("sparkqueue.storage", "sparkqueue.errors"),
    "sparkqueue.model": ("sparkqueue.model", "sparkqueue.storage", "sparkqueue.errors", "sparkqueue.constants"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(path: Path) -> list[str]:
    """Layer and private-name violations of one module."""
    me = module_name(path)
    layer = next((prefix for prefix in ALLOWED if me == prefix or me.startswith(prefix + ".")), None)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            targets += [(a.name, []) for a in node.names]
        for module, names in targets:
            if not module.startswith("sparkqueue"):
                continue
            if layer is not None and not any(module == a or module.startswith(a + ".") for a in ALLOWED[layer]):
                out.append(f"{path}:{node.lineno}: {me} ({layer}) imports {module}: imports flow downward only")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                out.append(f"{path}:{node.lineno}: {me} imports private {', '.join(private)} from {module}")
    return out


def main() -> int:
    found = [v for path in sorted(PACKAGE.rglob("*.py")) for v in violations(path)]
    for v in found:
        print(v, file=sys.stderr)
    print(f"import layers: {len(found)} violation(s)" if found else "import layers: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
