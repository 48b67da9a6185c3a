"""Timing a train step the way every benchmark here does: the state threads through
the calls (a donated state cannot be reused), the first call (compilation) and
`warmup` more are not timed, and each timed call is blocked on. Also the GPT step
the step-time benchmarks share, with its command-line knobs, and rounds that time
several contenders in turn (`interleaved_rounds`) for figures that must hold on a
shared machine."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
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


class Stepper:
    """One contender of `interleaved_rounds`: a step and the state it threads through
    its calls, so that its rounds continue where the previous one left off."""

    def __init__(self, step: Callable, state: Any, batch: Any):
        self.step, self.state, self.batch = step, state, batch

    def warm_up(self, calls: int) -> None:
        """The first call (compilation) and `calls - 1` more, untimed."""
        import jax

        for _ in range(max(1, calls)):
            self.state, out = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, out))

    def times(self, calls: int) -> tuple[list[float], list[float]]:
        """Wall seconds and this process's CPU seconds (all its threads: the virtual
        devices' too) of each of `calls` timed calls, each blocked on."""
        import jax

        wall, cpu = [], []
        for _ in range(calls):
            start, start_cpu = time.perf_counter(), time.process_time()
            self.state, out = self.step(self.state, self.batch)
            jax.block_until_ready((self.state, out))
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return wall, cpu


@dataclass
class Rounds:
    """Per contender, per round: the median wall and CPU seconds of its steps."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def ratios(self, name: str, base: str, cpu: bool = False) -> list[float]:
        """`name`'s time over `base`'s, round by round."""
        times = self.cpu if cpu else self.wall
        return [a / b for a, b in zip(times[name], times[base])]


def interleaved_rounds(contenders: dict[str, Stepper], rounds: int, steps: int) -> Rounds:
    """Every contender's steps timed in `rounds` rounds of `steps` calls each.

    On a machine shared with other work the speed drifts over seconds, so timing one
    contender's steps and then another's compares different machines. Here each
    round times every contender in turn, a few steps each, and the order rotates
    every round (no contender always runs first, just after another's), so a ratio
    of two contenders' times within one round sees the same load; the median of the
    per-round ratios then drops the rounds a burst of other work fell into."""
    names = list(contenders)
    out = Rounds({name: [] for name in names}, {name: [] for name in names})
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, cpu = contenders[name].times(steps)
            out.wall[name].append(statistics.median(wall))
            out.cpu[name].append(statistics.median(cpu))
    return out


def ratio_spread(ratios: list[float]) -> str:
    """The per-round ratios' median, quartiles and range, as one line."""
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return (f"median {statistics.median(ratios):.3f}, quartiles {q1:.3f}..{q3:.3f}, "
            f"range {min(ratios):.3f}..{max(ratios):.3f} over {len(ratios)} rounds")


def gpt_benchmark(description: str, iters: int, rounds: int | None = None) -> tuple[argparse.Namespace, Any]:
    """The command line (batch size, layers, microbatches, timed steps; rounds for
    `interleaved_rounds` where `rounds` gives their default) and the workload of
    the benchmark GPT (d_model 128, 4 heads, 64 tokens, 256 words)."""
    from models import gpt

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=iters)
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    config = gpt.GPTConfig(n_layers=args.layers, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    return args, gpt.setup(batch_size=args.batch_size, config=config)
