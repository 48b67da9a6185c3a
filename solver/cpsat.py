"""One way to make a CP-SAT solver, so every solve in solver/ behaves alike.

CP-SAT installs its own SIGINT handler by default (`catch_sigint_signal`): Ctrl-C
then stops the search quietly and, once the solve has returned, leaves the process
without Python's handler, so a later Ctrl-C kills it (a notebook loses its kernel).
hetpar turns that off: Ctrl-C raises KeyboardInterrupt in the caller, as anywhere
else in Python.
"""

from __future__ import annotations

from ortools.sat.python import cp_model


def cp_solver(time_limit_s: float, num_workers: int | None = None, seed: int | None = None) -> cp_model.CpSolver:
    """A CpSolver with a time limit that leaves SIGINT to Python."""
    solver = cp_model.CpSolver()
    solver.parameters.catch_sigint_signal = False
    solver.parameters.max_time_in_seconds = time_limit_s
    if num_workers is not None:
        solver.parameters.num_workers = num_workers
    if seed is not None:
        solver.parameters.random_seed = seed
    return solver
