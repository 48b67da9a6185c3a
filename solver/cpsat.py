"""One way to make a CP-SAT solver, so every solve in solver/ behaves alike.

CP-SAT installs its own SIGINT handler by default (`catch_sigint_signal`): Ctrl-C
then stops the search quietly and, once the solve has returned, leaves the process
without Python's handler, so a later Ctrl-C kills it (a notebook loses its kernel).
hetpar turns that off: Ctrl-C raises KeyboardInterrupt in the caller, as anywhere
else in Python.

A time limit is CP-SAT's deterministic time (work counted, about a second of a
typical core per unit), not wall time: on a loaded host a wall-clock limit hands
the search a fraction of a core, and the plan then depends on what else ran (a
Llama-2-7B stage's solve that proves its optimum in 2 s of CPU stopped at its
5 s wall limit 3% short, under a load of 12 on 2 cores, and its plan changed). Wall
time is capped at `WALL_FACTOR` times the limit so a starved host still gets an answer.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

WALL_FACTOR = 10.0


def cp_solver(time_limit_s: float, num_workers: int | None = None, seed: int | None = None) -> cp_model.CpSolver:
    """A CpSolver with a (deterministic) time limit that leaves SIGINT to Python."""
    solver = cp_model.CpSolver()
    solver.parameters.catch_sigint_signal = False
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = WALL_FACTOR * time_limit_s
    if num_workers is not None:
        solver.parameters.num_workers = num_workers
    if seed is not None:
        solver.parameters.random_seed = seed
    return solver
