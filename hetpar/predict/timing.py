"""Timing a program on a machine other work shares (CPU cores of a busy host, a GPU
beside other jobs): what the profile calibrates on and what the accuracy benchmark
measures, so both see the same statistic.

Which clock: on accelerators, wall time (the device runs the program; the host only
waits). On CPU virtual devices the "devices" are the host's cores, and wall time
there mostly measures the other processes on the host: with a load of 10 on 2 cores
the same program's wall time moves by 2x from run to run. What the program itself
costs the devices is the core-seconds it uses, the process's CPU time
(`time.process_time`: every thread, user and system), which another process taking
the cores does not inflate. That is also what the predictor's CPU model describes:
virtual devices split one host's throughput (`DeviceProfile.model_for`), so a
program's predicted time is the core time its devices' work adds up to, and a step's
is the sum of its programs' (`predict_step(concurrent=False)`).

A few warm-up runs (compilation, caches, allocator), then `rounds` x `repeats` timed
runs, of which the least is the figure. Several programs are timed interleaved
(`steady_times`): each round runs every program `repeats` times in turn, so every
program's rounds are spread over the whole measurement and all of them see the same
mix of quiet and busy moments. Timed one after the other instead, a program measured
while a neighbour's test suite ran came out up to 40% slower than the very same
program measured a minute later (CPU time too: a shared core's caches and memory
bandwidth slow every instruction), and the calibration fitted on one set of moments
predicted programs measured at others. Other work on the machine only ever adds to a
run (it takes the cores, evicts the caches, or leaves a device thread spinning while
its partner waits to be scheduled), so the fastest run is the one disturbed least:
the program's own time, which is what a prediction is of (timeit's reasoning). A
median keeps half the disturbance: on a 2-core host under a load of 10, one
step's CPU time had medians of 315 and 499 ms in consecutive rounds.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax

WARMUP = 2
ROUNDS = 3
MIN_ROUND_S = 0.02  # per run and round: short programs run more often


def busy_clock(platform: str | None = None) -> Callable[[], float]:
    """The clock that times the devices' work on `platform` (default: JAX's default
    backend): the process's CPU time on CPU devices, wall time elsewhere."""
    platform = platform or jax.default_backend()
    return time.process_time if platform == "cpu" else time.perf_counter


def steady_time(run: Callable[[], Any], repeats: int = 7, rounds: int = ROUNDS, warmup: int = WARMUP,
                clock: Callable[[], float] | None = None) -> float:
    """Seconds of one `run()` (its result blocked on) on `clock` (`busy_clock()` by
    default): the least of `rounds` x `repeats` runs."""
    return steady_times([run], repeats, rounds, warmup, [clock])[0]


def steady_times(runs: Sequence[Callable[[], Any]], repeats: int = 3, rounds: int = ROUNDS, warmup: int = WARMUP,
                 clocks: Sequence[Callable[[], float] | None] | None = None, min_round_s: float = MIN_ROUND_S) -> list[float]:
    """`steady_time` of each of `runs`, timed interleaved: round after round, each run
    `repeats` times in turn, and more while its runs in the round add up to less than
    `min_round_s` (a sub-millisecond program gets as many chances at an undisturbed
    run as a long one, at no great cost); per run the least. `clocks`: one per run
    (None: `busy_clock()`)."""
    clocks = [c or busy_clock() for c in (clocks or [None] * len(runs))]
    for run in runs:
        for _ in range(max(1, warmup)):
            jax.block_until_ready(run())
    least = [float("inf")] * len(runs)
    for _ in range(max(1, rounds)):
        for i, (run, clock) in enumerate(zip(runs, clocks)):
            spent, count = 0.0, 0
            while count < max(1, repeats) or spent < min_round_s:
                start = clock()
                jax.block_until_ready(run())
                took = clock() - start
                least[i], spent, count = min(least[i], took), spent + took, count + 1
    return least


def median_times(runs: Sequence[Callable[[], Any]], rounds: int = 7, warmup: int = WARMUP,
                 clock: Callable[[], float] | None = None) -> list[float]:
    """Per run, the median of `rounds` timed runs on `clock` (`busy_clock()` by
    default), interleaved: each round runs every one of `runs` once, in an order
    rotated by a place each round, so no run always follows the same neighbour and
    all of them see the same moments of a shared machine. A median rather than the
    least (`steady_times`): what layer profiles record and what the
    predicted-against-measured benchmark compares them with are medians of
    undisturbed and disturbed runs alike, so the two agree on the statistic."""
    import statistics

    clock = clock or busy_clock()
    for run in runs:
        for _ in range(max(1, warmup)):
            jax.block_until_ready(run())
    seen: list[list[float]] = [[] for _ in runs]
    n = len(runs)
    for r in range(max(1, rounds)):
        for k in range(n):
            i = (k + r) % n
            start = clock()
            jax.block_until_ready(runs[i]())
            seen[i].append(clock() - start)
    return [statistics.median(s) for s in seen]
