"""Print the package's import graph and its cycles (`python tools/import_graph.py`).

Every `import` of an `ort_autopatch` module counts, at module level or inside a function (the
engine imports lazily), except under `if TYPE_CHECKING:`. A name imported from a package
(`from ort_autopatch.engine import dlpack`) is an edge to that submodule when one exists, else
to the package. Exits 1 when the graph has a cycle. docs/architecture.md shows its output.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ort_autopatch"


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports at run time."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    edges.add(sub)
                elif base in known:
                    edges.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges.discard(name)
    return edges


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return groups


def layers(edges: dict[str, set[str]], under: str) -> dict[int, list[str]]:
    """Modules under `under` by layer: each imports only modules of lower layers (within
    `under`). Only an acyclic graph has layers."""
    inside = {m: {d for d in deps if d.startswith(under)} for m, deps in edges.items()}
    depth: dict[str, int] = {}

    def level(m: str) -> int:
        if m not in depth:
            depth[m] = 1 + max((level(d) for d in inside.get(m, ())), default=-1)
        return depth[m]

    found: dict[int, list[str]] = {}
    for m in sorted(inside):
        if m.startswith(under):
            found.setdefault(level(m), []).append(m)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--under", default=PACKAGE, help="only modules under this prefix")
    parser.add_argument(
        "--layers", action="store_true", help="modules by layer (each imports only lower ones)"
    )
    args = parser.parse_args()
    edges = graph()
    found = cycles(edges)
    if args.layers and not found:
        for k, group in sorted(layers(edges, args.under).items()):
            names = (m[len(args.under) :].lstrip(".") or "__init__" for m in group)
            print(f"{k:2d}  {', '.join(names)}")
        return 0

    def short(module: str) -> str:
        return module[len(PACKAGE) + 1 :] or PACKAGE

    for name in sorted(edges):
        if name.startswith(args.under):
            print(f"{short(name)} -> {', '.join(sorted(map(short, edges[name]))) or '-'}")
    for group in found:
        print("cycle:", " <-> ".join(group))
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
