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

A few warm-up runs (compilation, caches, allocator), then `rounds` rounds of
`repeats` runs; each round's median drops single outliers, and the least of the
rounds' medians is the round other processes disturbed least: the program's own
time, which is what a prediction is of. One round is the plain median.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax

WARMUP = 2
ROUNDS = 3


def busy_clock(platform: str | None = None) -> Callable[[], float]:
    """The clock that times the devices' work on `platform` (default: JAX's default
    backend): the process's CPU time on CPU devices, wall time elsewhere."""
    platform = platform or jax.default_backend()
    return time.process_time if platform == "cpu" else time.perf_counter


def steady_time(run: Callable[[], Any], repeats: int = 7, rounds: int = ROUNDS, warmup: int = WARMUP,
                clock: Callable[[], float] | None = None) -> float:
    """Seconds of one `run()` (its result blocked on) on `clock` (`busy_clock()` by
    default): the least round median."""
    clock = clock or busy_clock()
    for _ in range(max(1, warmup)):
        jax.block_until_ready(run())
    medians = []
    for _ in range(max(1, rounds)):
        times = []
        for _ in range(max(1, repeats)):
            start = clock()
            jax.block_until_ready(run())
            times.append(clock() - start)
        medians.append(statistics.median(times))
    return min(medians)
