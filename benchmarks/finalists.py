"""How far is the search's closed form from the estimator, and how many finalists
does that cost? Per scenario of `search_scale.py`:

- finalists needed: the fewest finalists (the search's best plans by its closed
  form, which the estimator then ranks) with which the planner chooses a plan as
  fast, by the estimator, as with ten times the default (`FINALISTS`);
- on those ten-times finalists, single pipelines only, the estimator's simulated
  step over the closed form per schedule, split into its two causes:
  - stalls: the simulation without tails (gradient sync, optimizer) over the
    closed form without them. A 1F1B stage keeps as many microbatches in flight as
    stages from it to the end, so a run of stages i..k turns over at most k - i + 1
    microbatches per round trip through them (their forwards, backwards and the
    sends both ways between them): where large sends sit between busy stages that
    round trip, not the slowest stage, sets the pace (`cycle_pace`). The closed form
    takes the whole pipeline's (the first stage's round trip, which keeps the split
    one shortest path per bound, `solver.planner.layer_split`); the shorter runs'
    are what stalls it still misses;
  - tails: what the tails add in the simulation over what the closed form adds (the
    slowest tail, after everything); negative where stages that finish their last
    backward early hide their tails under the others' drain;
- for 1F1B, the stall left once the closed form's pace is raised to every run's
  in-flight cycle (`cycle_pace`): how much of the stall the cycles explain.

The search is exact for its closed form, and ranks an interleaved plan (whose split is
close, not exact) by its simulated step where slower, so the interleaved stalls below
never put a plan ahead of where the estimator would; the finalists bridge the rest of
the gap to the estimator (tails hidden, short runs' stalls), and the search's time grows
with them (`README.md`, search speed).
Ends with: RESULT finalists_needed_max=<n> stall_max=<fraction> tails_hidden_max=<fraction> cycle_residual_max=<fraction>
Run: .venv/bin/python benchmarks/finalists.py [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_scale import SCENARIOS  # noqa: E402

from solver.pipeline_sim import pipeline_time, step_time  # noqa: E402
from solver.planner import Planner, PlanChoice  # noqa: E402
from solver.planner.search import FINALISTS  # noqa: E402
from solver.planner.step import stage_times  # noqa: E402
from solver.schedules import StageTimes  # noqa: E402


def cycle_pace(stages: Sequence[StageTimes]) -> float:
    """1F1B's steady pace with its in-flight limits: the slowest stage or send, or a
    run of stages i..k's forwards, backwards and sends both ways shared over the k - i + 1
    microbatches the run keeps in flight, whichever is slowest."""
    per_mb = [s.forward_s + s.backward_s for s in stages]
    pace = max(per_mb + [s.send_s for s in stages[:-1]])
    for i in range(len(stages)):
        total = 0.0
        for k in range(i, len(stages)):
            total += per_mb[k]
            pace = max(pace, total / (k - i + 1))
            total += 2 * stages[k].send_s
    return pace


def needed(problem_of, wide: float) -> int:  # noqa: ANN001
    """The fewest finalists whose choice is as fast as `wide`, the step chosen with ten times the default."""
    for k in range(1, 10 * FINALISTS + 1):
        if Planner(problem_of(), top_k=1, finalists=k).solve().best.step_s <= wide * (1 + 1e-9):
            return k
    return 10 * FINALISTS


def gaps(choice: PlanChoice) -> tuple[float, float, float]:
    """(stall, tails, 1F1B stall left under `cycle_pace`), each a fraction of the closed form."""
    times, m, schedule, chunks = stage_times(choice, 0), choice.num_microbatches, choice.schedule, choice.chunks
    bare = [replace(s, sync_s=0.0, optimizer_s=0.0) for s in times]
    form, form_bare = pipeline_time(times, m, schedule, chunks), pipeline_time(bare, m, schedule, chunks)
    sim, sim_bare = step_time(times, m, schedule, chunks), step_time(bare, m, schedule, chunks)
    left = 0.0
    if schedule == "1f1b":
        per_mb = [s.forward_s + s.backward_s for s in bare]
        cycled = sum(per_mb) + 2 * sum(s.send_s for s in bare[:-1]) + (m - 1) * cycle_pace(bare)
        left = sim_bare / cycled - 1
    return sim_bare / form_bare - 1, ((sim - sim_bare) - (form - form_bare)) / form, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    most, stall_max, hidden_max, left_max = 0, 0.0, 0.0, 0.0
    for name in args.scenario or list(SCENARIOS):
        scenario = SCENARIOS[name]
        wide = Planner(scenario.problem(), top_k=10 * FINALISTS, finalists=10 * FINALISTS).solve()
        k = needed(scenario.problem, wide.best.step_s)
        most = max(most, k)
        print(f"{name}: {k} finalist{'s' if k > 1 else ''} needed (the default keeps {FINALISTS}); "
              f"with {10 * FINALISTS}: {wide.best.describe()}, {wide.best.step_s:.4f} s")
        pipelines = [c for c in (wide.best, *wide.alternatives)
                     if len(c.replica_batch) == 1 and all(s.part_of < 0 for s in c.stages) and not c.mixed]
        for schedule in sorted({c.schedule for c in pipelines}):
            each = [gaps(c) for c in pipelines if c.schedule == schedule]
            stalls, tails, left = zip(*each)
            stall_max, hidden_max = max(stall_max, *stalls), max(hidden_max, -min(tails))
            line = (f"  {schedule} ({len(each)} plans): stalls {min(stalls):+.1%}..{max(stalls):+.1%}, "
                    f"tails {min(tails):+.1%}..{max(tails):+.1%}")
            if schedule == "1f1b":
                left_max = max(left_max, *(abs(x) for x in left))
                line += f"; stall left under the in-flight cycles' pace {min(left):+.2%}..{max(left):+.2%}"
            print(line)
    print(f"RESULT finalists_needed_max={most} stall_max={stall_max:.3f} tails_hidden_max={hidden_max:.3f} "
          f"cycle_residual_max={left_max:.4f}")


if __name__ == "__main__":
    main()
