"""The import graph of python/kvpool has no cycle, and the package imports its own modules
inside functions only where the allowlist below says why.

The graph is built from the source with `ast`: an edge A -> B for every `import kvpool.B` or
`from kvpool.B import x` in A (relative imports resolved; `from kvpool.pkg import name` points
at kvpool.pkg.name when that is a module), at module level or inside a function. Imports under
`if TYPE_CHECKING:` never run and are left out. `python tests/test_import_graph.py` prints the
graph's summary and its cycles.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "python" / "kvpool"

# (importing module, imported module) -> why that import sits inside a function. Only an
# import that defers an optional dependency belongs here; today there is none (the optional
# libraries themselves, cupy or torch, are imported lazily where they are used).
FUNCTION_LOCAL_ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module
    target: str  # the kvpool module imported
    line: int
    in_function: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool):
    """(import node, inside a function) for every import that can run."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            # The else branch runs: walk it as a block, so an import written directly in it
            # counts (walking each statement's children would skip the statement itself).
            else_block = ast.Module(body=child.orelse, type_ignores=[])
            yield from _walk(else_block, in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield from _walk(child, nested)


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect(root: Path = PACKAGE_DIR) -> tuple[set[str], list[Import]]:
    """Every module of the package, and every import of one of them by another."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    imports: list[Import] = []
    for path in paths:
        source = module_name(path, root)
        is_package = path.name == "__init__.py"
        for node, in_function in _walk(ast.parse(path.read_text(), str(path)), False):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(source, is_package, node)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in dict.fromkeys(targets):
                if target in modules and target != source:
                    imports.append(Import(source, target, node.lineno, in_function))
    return modules, imports


def find_cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def describe_cycle(component: list[str], imports: list[Import]) -> str:
    members = set(component)
    edges = [
        f"  {i.source} -> {i.target} (line {i.line}{', in a function' if i.in_function else ''})"
        for i in imports
        if i.source in members and i.target in members
    ]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def function_local(imports: list[Import]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for i in imports:
        if i.in_function:
            out.setdefault((i.source, i.target), []).append(i.line)
    return out


def test_the_import_graph_has_no_cycle():
    modules, imports = collect()
    cycles = find_cycles(modules, imports)
    for c in cycles:
        print(describe_cycle(c, imports))
    assert not cycles, f"{len(cycles)} import cycles (printed above)"


def test_function_local_imports_of_the_package_are_the_allowed_ones():
    _, imports = collect()
    found = function_local(imports)
    for (source, target), lines in sorted(found.items()):
        print(f"{source} -> {target} at lines {lines}")
    assert set(found) == set(FUNCTION_LOCAL_ALLOWED), (
        f"not allowed: {sorted(set(found) - set(FUNCTION_LOCAL_ALLOWED))}; "
        f"allowed but gone: {sorted(set(FUNCTION_LOCAL_ALLOWED) - set(found))}"
    )


def test_the_scheduler_and_the_generation_loop_do_not_import_the_simulator():
    _, imports = collect()
    offending = [
        i
        for i in imports
        if i.source.startswith(("kvpool.scheduler", "kvpool.generation"))
        and i.target.startswith("kvpool.sim")
    ]
    assert not offending, offending


def test_the_graph_sees_relative_imports_submodules_and_cycles(tmp_path):
    pkg = tmp_path / "kvpool"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kvpool.sub import b\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvpool.c\n"
    )
    (pkg / "c.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import kvpool.sub.b\n")
    modules, imports = collect(pkg)
    edges = {(i.source, i.target, i.in_function) for i in imports}
    assert edges == {
        ("kvpool", "kvpool.sub.b", False),
        ("kvpool.sub.b", "kvpool.a", True),
        ("kvpool.sub.b", "kvpool.sub.c", True),
        ("kvpool.sub.c", "kvpool.sub.b", False),
    }
    assert find_cycles(modules, imports) == [["kvpool.sub.b", "kvpool.sub.c"]]


def main() -> int:
    modules, imports = collect()
    cycles = find_cycles(modules, imports)
    edges = {(i.source, i.target) for i in imports}
    local = function_local(imports)
    print(f"modules: {len(modules)}")
    print(f"edges: {len(edges)} (module pairs A -> B)")
    print(f"function-local imports of kvpool modules: {len(local)}")
    for (source, target), lines in sorted(local.items()):
        reason = FUNCTION_LOCAL_ALLOWED.get((source, target), "NOT ALLOWED")
        print(f"  {source} -> {target} (lines {lines}): {reason}")
    print(f"cycles: {len(cycles) or 'none'}")
    for c in cycles:
        print(describe_cycle(c, imports))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
