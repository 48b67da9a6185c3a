"""Does a change to the planner's search leave its answers alone? Records, per
scenario of `search_scale.py` and per seeded random small problem (tests/
test_planner.py's generator), the finalists the search hands the estimator (each
plan's decisions and closed-form step) and the ranked plans it returns, and
compares them with a saved run: a speed-up must choose the same plans.

Run: .venv/bin/python benchmarks/search_identity.py --save ref.json   (before the change)
     .venv/bin/python benchmarks/search_identity.py --check ref.json  (after it)
Options: --scenario NAME (repeatable; default all), --finalists K, --random N
(seeded random problems, default 40)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from search_scale import SCENARIOS  # noqa: E402

from solver.planner import PlanningError, search  # noqa: E402
from solver.planner.search import FINALISTS, Planner  # noqa: E402


def _plans(choices) -> list[list]:  # noqa: ANN001
    return [[c.describe(), repr(c.step_s), [s.memory_bytes for s in c.stages]] for c in choices]


def record(problem, finalists: int) -> dict:  # noqa: ANN001
    """The closed-form finalists (in the order the estimator gets them) and the ranked answer."""
    seen: list = []
    rank = search.rank

    def capture(problem_, choices, costs=None, exact_to=None):  # noqa: ANN001, ANN202
        seen.append(_plans(choices))
        return rank(problem_, choices, costs, exact_to)

    search.rank = capture
    try:
        result = Planner(problem, top_k=finalists, finalists=finalists).solve()
    except PlanningError as e:
        return {"error": str(e)}
    finally:
        search.rank = rank
    return {"finalists": seen[0], "ranked": _plans((result.best, *result.alternatives)), "per_kind": seen[1:]}


def _as_recorded(now, was):  # noqa: ANN001, ANN202
    """`now` cut to what `was` records (a reference saved before stage memory was recorded)."""
    if isinstance(now, dict) and isinstance(was, dict):
        return {k: _as_recorded(v, was.get(k, v)) for k, v in now.items()}
    if isinstance(now, list) and isinstance(was, list):
        if now and isinstance(now[0], str) and len(was) < len(now):  # one plan: [describe, step, memory]
            return now[: len(was)]
        return [_as_recorded(a, b) for a, b in zip(now, was)] + now[len(was):]
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save")
    parser.add_argument("--check")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--finalists", type=int, default=FINALISTS)
    parser.add_argument("--random", type=int, default=40)
    args = parser.parse_args()
    from test_planner import random_problem

    out: dict[str, dict] = {}
    for name in args.scenario or list(SCENARIOS):
        started = time.process_time()
        out[name] = record(SCENARIOS[name].problem(), args.finalists)
        print(f"{name}: {time.process_time() - started:.2f} s cpu", flush=True)
    for seed in range(args.random):
        rng = np.random.default_rng(seed)
        out[f"random{seed}"] = record(random_problem(rng, allow_replicas=seed % 2 == 0), args.finalists)
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=1))
    if args.check:
        ref = json.loads(Path(args.check).read_text())
        out = {name: _as_recorded(record, ref.get(name, record)) for name, record in out.items()}
        bad = [name for name in out if name in ref and out[name] != ref[name]]
        for name in bad:
            print(f"DIFFERS: {name}")
            for key in ref[name]:
                if out[name].get(key) != ref[name][key]:
                    print(f"  {key}: was {str(ref[name][key])[:300]}\n  {' ' * len(key)}  now {str(out[name].get(key))[:300]}")
        print(f"{len(out) - len(bad)} of {len(out)} identical" + (f"; {len(out) - len([n for n in out if n in ref])} not in the reference" if any(n not in ref for n in out) else ""))
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
