"""The import graph of kwplug's own modules, read with ``ast`` (nothing is imported), and the
four architecture counts ``tests/gates/test_layers.py`` keeps at their targets (issue 29).

Every ``import``/``from ... import`` statement counts: at module level, inside a function, and
under ``if TYPE_CHECKING:``. ``from P import n`` points at ``P.n`` when that is a module; when
``P`` is a package that only re-exports ``n`` (its ``__init__`` binds ``n`` by an import,
eagerly or for type checkers), at the module defining ``n``: a package's face is transparent,
the dependency is on the definition. Anything else points at ``P``.

Run as a script to print the counts of a checkout::

    python tests/gates/import_graph.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The source folders and the package each holds (pyproject.toml's ``package-dir``).
SOURCES = (("core", "kwplug"), ("plugins", "kwplug.plugins"))
#: When an import runs: at import, when its function runs, or only for type checkers.
KINDS = ("module", "function", "type")


@dataclass(frozen=True)
class Import:
    """One imported module (or name) of one statement.

    Attributes:
        source: the importing module; target: the module depended upon; line: where;
        kind: ``"module"`` (runs at import), ``"function"`` (runs when the function does) or
        ``"type"`` (under ``if TYPE_CHECKING:``); path: what the statement names
        (``kwplug.accelerator._setup._init_process_group``), for the private-name count.
    """

    source: str
    target: str
    line: int
    kind: str
    path: str


@dataclass
class Graph:
    """kwplug's modules (name -> file) and every import between them."""

    files: dict[str, Path]
    packages: set[str]
    imports: list[Import] = field(default_factory=list)

    def edges(
        self, kinds: tuple[str, ...] = ("module", "function", "type")
    ) -> set[tuple[str, str]]:
        """``(source, target)`` pairs of the imports of ``kinds``, without self-imports."""
        return {
            (i.source, i.target) for i in self.imports if i.kind in kinds and i.source != i.target
        }


def modules(root: Path) -> tuple[dict[str, Path], set[str]]:
    """Module name -> file, and the names that are packages, under ``root``'s sources."""
    files: dict[str, Path] = {}
    packages: set[str] = set()
    for folder, package in SOURCES:
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
                packages.add(".".join([package, *parts]))
            files[".".join([package, *parts])] = path
    return files, packages


def _statements(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement with its kind."""

    def visit(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "type" if kind == "type" else "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), "type")
                for statement in child.orelse:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)

    yield from visit(tree, "module")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(statement: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not statement.level:
        return statement.module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - statement.level + 1]
    return ".".join([*base, statement.module] if statement.module else base)


def build(root: Path) -> Graph:
    """The graph of the checkout at ``root``."""
    files, packages = modules(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    graph = Graph(files, packages)
    # name -> the module a package's __init__ takes it from (its re-exports)
    reexports: dict[str, dict[str, str]] = {p: {} for p in packages}
    for package in packages:
        for statement, _ in _statements(trees[package]):
            if isinstance(statement, ast.ImportFrom):
                origin = _absolute(statement, package, True)
                for alias in statement.names:
                    reexports[package][alias.asname or alias.name] = f"{origin}.{alias.name}"

    def resolve(dotted: str, seen: frozenset[str] = frozenset()) -> str | None:
        # The kwplug module that ``dotted`` (a module, or a module's name) stands for.
        if dotted in files:
            return dotted
        owner, _, name = dotted.rpartition(".")
        if owner in reexports and name in reexports[owner] and dotted not in seen:
            return resolve(reexports[owner][name], seen | {dotted})
        return owner if owner in files else None

    for source, tree in trees.items():
        for statement, kind in _statements(tree):
            if isinstance(statement, ast.Import):
                named = [alias.name for alias in statement.names]
            else:
                origin = _absolute(statement, source, source in packages)
                named = [f"{origin}.{alias.name}" for alias in statement.names]
            for path in named:
                target = resolve(path)
                if target is not None:
                    graph.imports.append(Import(source, target, statement.lineno, kind, path))
    return graph


def cycles(edges: set[tuple[str, str]]) -> list[frozenset[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    following: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        following.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in following.get(node, []):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(following):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def reaches(edges: set[tuple[str, str]], start: str, goal: str) -> bool:
    """Whether ``start`` imports ``goal``, directly or through other modules, over ``edges``."""
    following: dict[str, set[str]] = {}
    for a, b in edges:
        following.setdefault(a, set()).add(b)
    seen, todo = {start}, [start]
    while todo:
        for nxt in following.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def loop_breakers(graph: Graph) -> list[Import]:
    """Function-local imports that exist only to break a loop: ``A`` imports ``B`` inside a
    function while ``B`` imports ``A`` (directly or transitively) at module level."""
    at_import = graph.edges(("module",))
    return [
        i
        for i in graph.imports
        if i.kind == "function" and i.source != i.target and reaches(at_import, i.target, i.source)
    ]


def _inside(module: str, package: str) -> bool:
    # kwplug's plugins package is held to a third-party plugin's rules: kwplug's core private
    # names are outside it.
    if module.startswith("kwplug.plugins") and not package.startswith("kwplug.plugins"):
        return False
    return module == package or module.startswith(package + ".")


def private_crossings(graph: Graph) -> list[tuple[Import, str]]:
    """Imports naming a private module or name (``_x``) from outside the package owning it,
    each with that owner. A private segment of a dotted path belongs to the package it sits in
    (a private name of a module, to that module's package)."""
    found = []
    for i in graph.imports:
        parts = i.path.split(".")
        for n, part in enumerate(parts):
            if not part.startswith("_") or part.startswith("__"):
                continue
            owner = ".".join(parts[:n])
            if owner not in graph.packages:  # a module's private name: its package owns it
                owner = owner.rpartition(".")[0]
            if not _inside(i.source, owner):
                found.append((i, owner))
                break
    return found


def layer_violations(graph: Graph, layer_of: dict[str, int]) -> list[Import]:
    """Imports (one per pair of modules) from a module to one of a higher layer."""
    seen: set[tuple[str, str]] = set()
    found = []
    for i in graph.imports:
        pair = (i.source, i.target)
        if pair in seen or i.source == i.target:
            continue
        if layer_of[i.target] > layer_of[i.source]:
            seen.add(pair)
            found.append(i)
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).parents[2])
    graph = build(root)
    print(f"{len(graph.files)} modules, {len(graph.imports)} imports")
    for component in cycles(graph.edges()):
        print("circle:", sorted(component))
    for i in loop_breakers(graph):
        print(f"loop breaker: {i.source}:{i.line} -> {i.target}")
    for i, owner in private_crossings(graph):
        print(f"private: {i.source}:{i.line} {i.path} (owner {owner})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
