"""Imports run one way: ``launch -> runtime -> worker -> connector -> engine_core`` (and
``kernels`` at the bottom beside it), and no two rooms import each other. A room is a package's
own modules or one of its subpackages; imports inside functions and under TYPE_CHECKING count."""

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).parents[2]
LAYERS = {"strata": 6, "launch": 5, "runtime": 4, "worker": 3, "connector": 2, "engine_core": 1, "kernels": 1}


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(("strata", *parts)).removesuffix(".__init__")


def imported_modules(path: Path) -> set[str]:
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.add(".".join(part for part in (base, node.module) if part))
    return {name for name in found if name == "strata" or name.startswith("strata.")}


def room(module: str) -> str:
    """``strata.runtime.executors.mp_executor`` -> ``runtime.executors``, ``strata.runtime.core_client``
    -> ``runtime``: the package a module lives in (a package is its own), cut to two levels."""
    parts = module.split(".")[1:]
    if not REPO.joinpath(*parts, "__init__.py").exists():
        parts = parts[:-1]
    return ".".join(parts[:2]) or "strata"


def room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for folder in [REPO, *(REPO / name for name in LAYERS if name != "strata")]:
        for path in folder.glob("*.py") if folder == REPO else folder.rglob("*.py"):
            if path.name == "setup.py":
                continue
            source = room(module_of(path))
            for target in imported_modules(path):
                if room(target) != source:
                    graph[source].add(room(target))
    return graph


def layer(room_name: str) -> str:
    return room_name.split(".")[0]


def test_imports_between_layers_point_down():
    upward = [
        f"{source} -> {target}"
        for source, targets in room_graph().items()
        for target in targets
        if layer(source) != layer(target) and LAYERS[layer(source)] <= LAYERS[layer(target)]
    ]
    assert upward == []


def test_no_rooms_import_each_other_around_a_cycle():
    graph = room_graph()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for target in graph.get(node, ()):
            if target in path:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert cycles == []


def test_the_graph_sees_the_rooms_it_checks():
    graph = room_graph()
    assert "runtime" in graph["launch"] and "runtime.executors" in graph["runtime"]
    assert "engine_core" in graph["runtime.data_parallel"]
