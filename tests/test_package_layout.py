"""The house rules a reader relies on, checked: no import cycle inside the package (imports inside functions and
``if TYPE_CHECKING:`` blocks count), no source file over 400 lines, and no private name taken from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
# the installed namespace (pyproject.toml's package-dir): folder -> package name
PACKAGES = {"condcomp": "condcomp", "routers": "condcomp.routers", "policies": "condcomp.policies",
            "integrations": "condcomp.integrations"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports: a ``from pkg import x`` counts ``pkg`` only when some ``x`` is not a
    submodule (then it runs pkg's ``__init__`` for a name defined there)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path, node)
            subs = {f"{base}.{a.name}" for a in node.names} & known.keys()
            out |= subs | ({base} if len(subs) < len(node.names) else set())
    return (out & known.keys()) - {name}


def test_no_import_cycles() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)



def test_no_source_file_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, long


def private_uses(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """``module._name`` for every private name ``name`` takes from another package module: ``from m import _x``,
    or ``m._x`` where ``m`` is bound to a package module by an import."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the package module it is bound to
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path, node)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif is_private(a.name) and base in known and base != name:
                    found.add(f"{base}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            module = dotted(node.value, bound)
            if module in known and module != name:
                found.add(f"{module}.{node.attr}")
    return found


def resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against ``name``)."""
    base = node.module or ""
    if not node.level:
        return base
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{base}" if base else package


def dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` as a module name, its first part replaced by what the import bound it to (None: not a chain)."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        head = dotted(node.value, bound)
        return None if head is None else f"{head}.{node.attr}"
    return None


def is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_no_private_name_is_imported_across_modules() -> None:
    known = modules()
    found = {f"{name}: {use}" for name, path in known.items() for use in private_uses(name, path, known)}
    assert found == set(), sorted(found)
