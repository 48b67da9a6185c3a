"""The layout DESIGN.md promises, checked on the source: no import cycles in `hetpar`
or `solver` (lazy imports inside functions count), `solver/` never imports JAX or
hetpar, compile never imports the runtime, and the README's pass table names files
that exist."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hetpar", "solver")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path) -> set[str]:
    """Every module named by an import anywhere in the file, absolute."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        deps = {resolve(n) for n in _imported(name, path)} - {None, name}
        # `from hetpar.x import y` also names the package `hetpar`; only count a package
        # when the import names it alone.
        graph[name] = {d for d in deps if not any(o.startswith(d + ".") for o in deps)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_solver_never_imports_jax_or_hetpar():
    for name, path in _modules().items():
        if name.startswith("solver"):
            bad = {n for n in _imported(name, path) if n.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "hetpar")}
            assert not bad, f"{path} imports {sorted(bad)}"


def test_compile_never_imports_the_runtime():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("hetpar.compile"):
            assert not {d for d in deps if d.startswith("hetpar.runtime")}, f"{name} imports {deps}"


def test_every_file_the_readme_names_in_how_it_works_exists():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How it works", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:hetpar|solver)/[\w/.]+)`", section)
    assert named, "the README's How it works table names no module"
    missing = [n for n in named if not (ROOT / n).exists()]
    assert not missing, f"the README names files that do not exist: {missing}"


def test_passes_import_forward_only():
    """Trace knows no plans; compile and the runtime read the Plan but never plan,
    shard or solve."""
    graph = _graph()
    planning = ("hetpar.pipeline", "hetpar.plan.auto", "hetpar.plan.manual", "hetpar.shard", "solver.planner", "solver.intra_op")
    for name, deps in graph.items():
        if name.startswith("hetpar.trace"):
            assert not {d for d in deps if d.startswith(("hetpar.plan", "hetpar.shard", "hetpar.compile", "hetpar.runtime"))}, name
        if name.startswith(("hetpar.compile", "hetpar.runtime")):
            assert not {d for d in deps if d.startswith(planning)}, f"{name} imports {deps}"
