"""No import cycle among the project's modules, counting the imports inside functions (a cycle
hidden in a function is still a cycle: it only fails later). Imports under `if TYPE_CHECKING:` are
annotations, never executed, and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("dualpath", "testbed", "emulators", "simulator")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        skip = _type_checking_only(tree)
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [owner(f"{base}.{a.name}") or owner(base) for a in node.names]
            else:
                continue
            graph[m].update(t for t in targets if t and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    files = {"pa": "def f():\n    from pb import g\n",  # inside a function: counts
             "pb": "import pc\ndef g(): pass\n",
             "pc": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pa\nimport pb\n"}
    mods = {}
    for name, text in files.items():
        mods[name] = tmp_path / f"{name}.py"
        mods[name].write_text(text)
    graph = import_graph(mods)
    assert graph == {"pa": {"pb"}, "pb": {"pc"}, "pc": {"pb"}}  # pc -> pa is an annotation only
    assert cycles(graph) == [["pb", "pc"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph(modules())
    assert "testbed.experiments.ablation" in graph["testbed.cli"] or "testbed.experiments.ablation" in graph["testbed.reproduce.execute"]
    assert cycles(graph) == []


# The rooms of the tree, highest first: a room may import only rooms below it (docs/architecture.md,
# "The folders are the layers"). testbed's topology and paths modules are its floor, under every room.
LAYERS = [
    ("testbed.cli", "testbed.api", "testbed.detach", "testbed.pytest_plugin"),
    ("testbed.reproduce",),
    ("testbed.sim", "testbed.experiments", "testbed.calibrate"),
    ("testbed.measure", "testbed.cluster"),
    ("testbed.fabric",),
    ("testbed.placement",),
    ("testbed.topology",),
    ("testbed.topology_servers",),
    ("testbed.topology_file",),
    ("testbed.paths",),
    ("simulator", "emulators"),
    ("dualpath",),
]


def layer_of(module: str) -> int:
    best = None
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > best[1]):
                best = (i, len(room))
    if best is None:
        raise AssertionError(f"{module} is in no layer; add its room to LAYERS and docs/architecture.md")
    return best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a room to a room above it (within one layer, rooms may not import each other
    either, except inside one room)."""
    def room(m: str) -> str:
        return next(r for rooms in LAYERS for r in rooms if m == r or m.startswith(r + "."))
    bad = []
    for m, targets in graph.items():
        if m == "testbed":  # the package's face hands on Testbed lazily
            continue
        for t in targets:
            if t == "testbed":
                continue
            if layer_of(t) < layer_of(m) or (layer_of(t) == layer_of(m) and room(t) != room(m) and layer_of(m) != 0):
                bad.append(f"{m} -> {t}")
    return sorted(bad)


def test_the_layer_check_catches_an_import_that_points_up():
    assert upward_imports({"testbed.fabric.network": {"testbed.measure.fidelity"}}) == \
        ["testbed.fabric.network -> testbed.measure.fidelity"]
    assert upward_imports({"testbed.sim.drive": {"testbed.experiments.ablation"}}) == \
        ["testbed.sim.drive -> testbed.experiments.ablation"]
    assert upward_imports({"testbed.reproduce.fig7": {"testbed.sim.drive", "dualpath.model"}}) == []


def test_imports_point_down_the_layers():
    assert upward_imports(import_graph(modules())) == []
