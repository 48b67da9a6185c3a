"""Timing a program on a machine other work shares (CPU cores of a busy host, a GPU
beside other jobs): what the profile calibrates on and what the accuracy benchmark
measures, so both see the same statistic.

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


def steady_time(run: Callable[[], Any], repeats: int = 7, rounds: int = ROUNDS, warmup: int = WARMUP) -> float:
    """Seconds of one `run()` (its result blocked on): the least round median."""
    for _ in range(max(1, warmup)):
        jax.block_until_ready(run())
    medians = []
    for _ in range(max(1, rounds)):
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians)
