"""ember's modules import one another without circles, in one direction between layers, and the
scheduler and KV manager stay free of torch.

Every import counts, at module level or inside a function, except those under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ember

PACKAGE = Path(ember.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("ember",) + path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every dotted name `path` imports, and for `from a import b` both a and a.b."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree)
                   if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                   for node in ast.walk(branch)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = _imports(path)
        # `from ember import kernels` imports the subpackage, not ember's __init__
        edges = {target for target in imported if target in modules and target != name}
        edges -= {target for target in edges if any(other.startswith(target + ".") for other in edges)}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _crossings(graph: dict[str, set[str]], lower: tuple[str, ...], upper: tuple[str, ...]) -> list[str]:
    """Every module under `upper` that a module under `lower` reaches, directly or through others,
    as the chain of imports that reaches it first (a breadth-first walk)."""
    reached_from: dict[str, str | None] = {name: None for name in graph if _within(name, lower)}
    todo = sorted(reached_from)
    while todo:
        name = todo.pop(0)
        for target in sorted(graph[name]):
            if target not in reached_from:
                reached_from[target] = name
                todo.append(target)
    chains = []
    for name in sorted(reached_from):
        if _within(name, upper):
            chain = [name]
            while reached_from[chain[-1]] is not None:
                chain.append(reached_from[chain[-1]])
            chains.append(" -> ".join(reversed(chain)))
    return chains


# (the layer below, the layers it may never import, at any depth)
LAYERS = [
    (("ember.engine", "ember.models", "ember.kernels", "ember.grammar"), ("ember.protocols", "ember.server")),
    (("ember.protocols",), ("ember.engine", "ember.server")),
    (("ember.tokenization",), ("ember.parsers",)),  # parsers read token bytes; tokenization knows no reply format
]


@pytest.mark.parametrize("lower, upper", LAYERS, ids=lambda packages: "+".join(p.split(".")[-1] for p in packages))
def test_a_layer_never_imports_the_layers_above_it(lower, upper):
    graph = _graph()
    assert all(any(_within(name, (package,)) for name in graph) for package in lower + upper)  # names are real
    crossings = _crossings(graph, lower, upper)
    assert not crossings, "\n".join(crossings)


def test_a_crossing_is_found_directly_or_through_others():
    graph = {"low.a": {"low.b"}, "low.b": {"mid.c"}, "mid.c": {"high.d"}, "high.d": set(), "high.e": {"low.a"},
             "lowly": {"high.e"}}  # "lowly" is no module of "low"
    assert _crossings(graph, ("low",), ("mid",)) == ["low.b -> mid.c"]
    assert _crossings(graph, ("low",), ("high",)) == ["low.b -> mid.c -> high.d"]
    assert _crossings(graph, ("high",), ("low",)) == ["high.e -> low.a", "high.e -> low.a -> low.b"]
    assert _crossings(graph, ("mid",), ("low",)) == []


def test_no_module_imports_itself_through_others():
    graph = _graph()
    assert len(graph) > 100 and graph["ember.server.pipeline"]  # the walk saw the package
    assert _cycles(graph) == []


def test_a_circle_is_found_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_scheduler_and_kv_manager_import_no_torch():
    """Nor does anything they import, at any depth."""
    modules, graph = _modules(), _graph()
    for root in ("ember.engine.scheduler", "ember.engine.kv_cache", "ember.engine.request"):
        reached, todo = set(), [root]
        while todo:
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo.extend(graph[name])
        torch_users = sorted(name for name in reached
                             if any(t == "torch" or t.startswith("torch.") for t in _imports(modules[name])))
        assert torch_users == [], f"{root} reaches torch through {torch_users}"
