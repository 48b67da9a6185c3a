"""Is the planner's search faster or slower than at another revision? Alternated in
one process, so both see the same slow and quiet spells of a shared machine.

On this 2-core machine single solves vary by a quarter and more and runs an hour
apart by half, so two separate runs of `search_scale.py` cannot tell a change of a
few percent. Here the other revision's `solver` package is loaded beside this one
(extracted with `git archive` and renamed `solver_base`, its imports rewritten), and
the two solve each scenario in turn, `--rounds` times each (who goes first alternates
by round), on problems built the same way (`search_scale.py`'s, by this revision: a
revision whose `Problem` differs cannot be compared so). Per scenario: each
side's least and median CPU seconds of a solve, and the median and quartiles of the
rounds' ratios (this revision's solve over the other's in the same round, a fraction of
a second apart: below 1, faster); the plans must be the same.

Run: .venv/bin/python benchmarks/search_ab.py --base f52fb64 [--scenario NAME ...] [--rounds N]
Ends with RESULT <scenario>_ratio=<the rounds' median ratio> ... for each scenario.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from search_scale import SCENARIOS  # noqa: E402

from solver.planner import Planner  # noqa: E402

_IMPORT = re.compile(r"\b(from|import) solver\b")


def base_planner(revision: str, folder: Path) -> type:
    """The Planner of `revision`'s `solver` package, loaded as `solver_base`."""
    archived = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "solver"], capture_output=True)
    if archived.returncode:
        raise SystemExit(f"--base {revision}: git cannot archive its solver package ({archived.stderr.decode().strip()}); "
                         "give a revision of this repository's history")
    archive = archived.stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    package = folder / "solver_base"
    (folder / "solver").rename(package)
    for source in package.rglob("*.py"):
        source.write_text(_IMPORT.sub(r"\1 solver_base", source.read_text()))
    sys.path.insert(0, str(folder))
    return importlib.import_module("solver_base.planner").Planner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--rounds", type=int, default=10, help="solves per side per scenario (default %(default)s)")
    args = parser.parse_args()
    ratios = {}
    with tempfile.TemporaryDirectory() as folder:
        sides = {"base": base_planner(args.base, Path(folder)), "this": Planner}
        for name in args.scenario or ["gpt34_64_3t", "gpt34_256_3t"]:
            scenario = SCENARIOS[name]
            times: dict[str, list[float]] = {"base": [], "this": []}
            plans: dict[str, set[str]] = {"base": set(), "this": set()}
            for side in ("base", "this", "base", "this"):  # warm each side's process-wide caches
                sides[side](scenario.problem(), top_k=1).solve()
            for r in range(args.rounds):
                for side in ("base", "this") if r % 2 == 0 else ("this", "base"):
                    problem = scenario.problem()
                    started = time.process_time()
                    result = sides[side](problem, top_k=1).solve()
                    times[side].append(time.process_time() - started)
                    plans[side].add(result.best.describe())
            if plans["base"] != plans["this"]:
                raise SystemExit(f"{name}: the revisions chose different plans: {plans}")
            least = {side: min(t) for side, t in times.items()}
            middle = {side: statistics.median(t) for side, t in times.items()}
            paired = sorted(a / b for a, b in zip(times["this"], times["base"]))
            quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            ratios[name] = statistics.median(paired)
            print(f"{name}: base least {least['base']:.3f} s, median {middle['base']:.3f}; this least {least['this']:.3f}, "
                  f"median {middle['this']:.3f}; the rounds' ratio {ratios[name]:.3f} (quartiles {quartiles[0]:.3f}-"
                  f"{quartiles[2]:.3f})")
    print("RESULT " + " ".join(f"{name}_ratio={ratio:.3f}" for name, ratio in ratios.items()))


if __name__ == "__main__":
    main()
