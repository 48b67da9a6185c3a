"""A stage's times for every ZeRO stage at once: per microbatch forward and backward, the
tail and its sync, over every layer range, stacked (ZeRO stage first).

`StageCosts.variant`'s times (`_times`) are the stage's layer sums plus what its ZeRO
stage's collectives add (`StageCosts.step_costs`), floored at zero. A table asks for
every ZeRO stage of the same stage and microbatch (`StageCosts.table_choices`), and
the floors of mixed stages ask for most of them again, so each sum is one numpy
operation over the stacked ZeRO stages, not one per stage; the forward, the same under
every recomputation, is summed once for both. Each figure is the one the per-stage sum
gives, bit for bit: the same elementwise operations in the same order
(`tests/test_choice_times.py`).

Not here: stages whose data axis overlaps its collectives with compute
(`StageCosts._overlapped`, priced per ZeRO stage) and a last stage's one program
(`StageCosts._fused_backward`, applied on top).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from solver.cost.ranges import full
from solver.cost.stage_config import StageConfig

StageCosts = Any  # solver.cost.stage_costs.StageCosts, which builds on this module (so not imported here)


class ZeroStack(NamedTuple):
    """One stage's times under each of `zeros`, (Z, L+1, L+1) each, read-only."""

    zeros: tuple[int, ...]
    forward: np.ndarray
    backward: np.ndarray
    tail: np.ndarray
    sync: np.ndarray


def _stacked(values: list[np.ndarray | float], shape: tuple[int, ...]) -> np.ndarray:
    """`values` (arrays of `shape`, views broadcast to it, or numbers) as one read-only stack."""
    out = np.stack([full(v, shape) for v in values])
    out.setflags(write=False)
    return out


class ChoiceTimes:
    """The stacked times of one problem's stages (`StageCosts._times`' arithmetic)."""

    def __init__(self, costs: StageCosts):
        self.costs = costs
        self.shape = (costs.n + 1, costs.n + 1)
        self._steps = lru_cache(maxsize=None)(self._steps_uncached)
        self._forward = lru_cache(maxsize=None)(self._forward_uncached)
        self.stack = lru_cache(maxsize=None)(self._stack_uncached)

    def zeros(self, cfg: StageConfig, zero: int) -> tuple[int, ...]:
        """The ZeRO stages priced together with `zero`: the stage's own (`zero_stages`,
        what its table picks among), or `zero` alone where it is not one of them."""
        zeros = tuple(self.costs.zero_stages(cfg))
        return zeros if zero in zeros else (zero,)

    def times(self, cfg: StageConfig, b: int, zero: int, remat: str) -> tuple[np.ndarray, ...]:
        """`StageCosts._times`' (forward, backward, tail, sync, hidden) under ZeRO stage
        `zero`, read from its stack (views of it)."""
        stack = self.stack(cfg, b, self.zeros(cfg, zero), remat)
        z = stack.zeros.index(zero)
        return stack.forward[z], stack.backward[z], stack.tail[z], stack.sync[z], 0.0

    def _steps_uncached(self, cfg: StageConfig, zeros: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """`step_costs` of each of `zeros`, stacked: what the forward and backward add, the
        sync, the tail (the same at every microbatch)."""
        rows = [self.costs.step_costs(cfg, zero) for zero in zeros]
        return tuple(_stacked([row[k] for row in rows], self.shape) for k in range(4))

    def _forward_uncached(self, cfg: StageConfig, b: int, zeros: tuple[int, ...]) -> np.ndarray:
        """The forward under each of `zeros`: the same with and without recomputation."""
        costs = self.costs
        f = costs._ranges(cfg, b)[0]
        extra_f = self._steps(cfg, zeros)[0]
        launch = costs.launches(cfg, b / cfg.dp)  # measured layers: one program's cost per stage program
        dispatch = costs.dispatches(cfg)  # and the runtime's host work to dispatch it (shared host only)
        # (a measured layer's net time may be below zero, `solver.cost.measured.lookup`; a stage's never)
        forward = np.maximum(f + extra_f + launch, 0.0) + dispatch
        forward.setflags(write=False)
        return forward

    def _stack_uncached(self, cfg: StageConfig, b: int, zeros: tuple[int, ...], remat: str) -> ZeroStack:
        costs = self.costs
        _, bw, _, _, rerun = costs._ranges(cfg, b)
        extra_f, extra_b, sync, tail = self._steps(cfg, zeros)
        launch, dispatch = costs.launches(cfg, b / cfg.dp), costs.dispatches(cfg)
        backward = np.maximum(bw + extra_b + launch + (rerun + extra_f if remat else 0.0), 0.0) + dispatch
        backward.setflags(write=False)
        return ZeroStack(zeros, self._forward(cfg, b, zeros), backward, tail, sync)
