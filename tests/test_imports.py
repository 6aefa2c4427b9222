"""The package's import graph, read from the source (AST, nothing imported): no import cycles, not
even through imports inside functions, and an engine core that needs neither Triton, click nor the
build side."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trtprompt"
# What the engine (trtprompt/engine and everything it imports) must never import, even lazily.
ENGINE_FORBIDDEN_EXTERNAL = ("tritonclient", "triton_python_backend_utils", "grpc", "click", "fastapi")
BUILD_SIDE = ("trtprompt.build", "trtprompt.plan", "trtprompt.checkpoint", "trtprompt.checkpoint_maker",
              "trtprompt.targets", "trtprompt.serve", "trtprompt.bench", "trtprompt.cli", "trtprompt.prompt")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(name: str, module_level_only: bool) -> set[str]:
    """Every dotted name the module imports (a `from a import b` gives a and a.b)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def graph(module_level_only: bool) -> dict[str, set[str]]:
    return {m: {i for i in imported_names(m, module_level_only) if i in MODULES and i != m} for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_even_through_function_level_imports() -> None:
    # An import inside a function still runs, and hiding a circle in one only defers it:
    # the module-level graph is a subset of this one, so this also covers it.
    assert len(MODULES) > 50
    assert cycles(graph(module_level_only=False)) == []


def test_the_engine_needs_neither_triton_nor_click_nor_the_build_side() -> None:
    edges = graph(module_level_only=False)  # lazy imports count: they run too
    engine = {m for m in MODULES if m == "trtprompt.engine" or m.startswith("trtprompt.engine.")}
    reached, todo = set(engine), list(engine)
    while todo:
        for dep in edges[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert "trtprompt.engine.engine" in reached and "trtprompt.engine.engine_dir" in reached
    build = sorted(m for m in reached if any(m == b or m.startswith(b + ".") for b in BUILD_SIDE))
    assert build == []
    external = sorted({name for m in reached for name in imported_names(m, module_level_only=False)
                       if name.split(".")[0] in ENGINE_FORBIDDEN_EXTERNAL})
    assert external == []
