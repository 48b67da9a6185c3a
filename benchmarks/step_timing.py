"""Timing a train step the way every benchmark here does: the state threads through
the calls (a donated state cannot be reused), the first call (compilation) and
`warmup` more are not timed, and each timed call is blocked on."""

from __future__ import annotations

import time
from typing import Any, Callable


def step_times(step: Callable, state: Any, batch: Any, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` timed calls of `state, out = step(state, batch)`."""
    import jax  # late: a multi-process benchmark sets up jax.distributed first

    for _ in range(1 + max(0, warmup)):
        state, out = step(state, batch)
    jax.block_until_ready((state, out))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - start)
    return times
