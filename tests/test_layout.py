"""The layout DESIGN.md promises. The layering itself (solver never imports JAX or
hetpar, the order of hetpar's layers, which packages must not know each other, no
cycles between sibling packages) is stated as import-linter contracts in
pyproject.toml; here the suite runs `lint-imports` so a broken contract fails a test
run as it fails CI. What the contracts cannot say is checked by hand: no module is
part of an import cycle (a package's `__init__` and its own modules included, which
the sibling-cycle contract does not see), and the README's pass table names files
that exist."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hetpar", "solver", "models")


def _env() -> dict[str, str]:
    """This checkout's packages first: hetpar may be installed editable from another."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_the_import_contracts_hold():
    """`lint-imports` exits non-zero when any contract in pyproject.toml is broken."""
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--no-cache", "--no-logo"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"lint-imports: a contract is broken\n{run.stdout}\n{run.stderr}"
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken" in run.stdout, run.stdout  # every contract was checked


def _module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One shortest cycle through each import that lies on a cycle (deduplicated)."""
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycle = [importer, *back[:-1]]
                start = cycle.index(min(cycle))
                cycles.add(tuple(cycle[start:] + cycle[:start]))
    return sorted(list(c) for c in cycles)


def test_no_module_is_part_of_an_import_cycle():
    sys.path.insert(0, str(ROOT))  # grimp finds the packages on sys.path: this checkout's
    try:
        graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    assert _module_cycles(graph) == []


def test_the_cycle_finder_finds_a_package_init_cycle():
    """The case the sibling-cycle contract misses: a package's __init__ and one of its
    own modules importing each other."""
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.model", "pkg.other"):
        graph.add_module(module)
    graph.add_import(importer="pkg", imported="pkg.model")
    graph.add_import(importer="pkg.model", imported="pkg")
    graph.add_import(importer="pkg.other", imported="pkg")
    assert _module_cycles(graph) == [["pkg", "pkg.model"]]


def test_every_file_the_readme_names_in_how_it_works_exists():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How it works", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:hetpar|solver)/[\w/.]+)`", section)
    assert named, "the README's How it works table names no module"
    missing = [n for n in named if not (ROOT / n).exists()]
    assert not missing, f"the README names files that do not exist: {missing}"
