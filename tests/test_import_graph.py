"""The module graph docs/architecture.md describes: no modules of radixserve
import each other in a loop, counting imports inside functions (one there
only to dodge a loop is still a loop), type-only imports and the
``"package.module:Class"`` strings of the lazy registries."""

from __future__ import annotations

import ast
from pathlib import Path

import radixserve

ROOT = Path(radixserve.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Every dotted name ``name``'s source imports or names in a registry string."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            out.update(f"{base}.{alias.name}" for alias in node.names)  # a module, or a name in ``base``
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("radixserve."):
            out.add(node.value.split(":")[0])
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}

    def known(dotted: str) -> str | None:  # the longest prefix that is one of our modules
        while dotted and dotted not in paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in paths.items():
        names = imported_names(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {m for m in map(known, names) if m is not None and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``graph`` as the modules along it, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_the_finder_sees_a_loop_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    tree = ast.parse("def f():\n    from radixserve.x import y\nREG = {'k': 'radixserve.z.w:Cls'}\n")
    assert imported_names(tree, "radixserve.m", False) >= {"radixserve.x.y", "radixserve.z.w"}


def test_no_modules_import_each_other_in_a_loop():
    graph = import_graph()
    assert len(graph) > 100 and graph["radixserve.model_executor.model_runner"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
