"""Timing a train step the way every benchmark here does: the state threads through
the calls (a donated state cannot be reused), the first call (compilation) and
`warmup` more are not timed, and each timed call is blocked on. Also the GPT step
the step-time benchmarks share, with its command-line knobs."""

from __future__ import annotations

import argparse
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


def gpt_benchmark(description: str, iters: int) -> tuple[argparse.Namespace, Any]:
    """The command line (batch size, layers, microbatches, timed steps) and the
    workload of the benchmark GPT (d_model 128, 4 heads, 64 tokens, 256 words)."""
    from models import gpt

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=iters)
    args = parser.parse_args()
    config = gpt.GPTConfig(n_layers=args.layers, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    return args, gpt.setup(batch_size=args.batch_size, config=config)
