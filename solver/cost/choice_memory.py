"""A stage table's memory for every (ZeRO stage, recomputation) choice at once.

A stage table (`StageCosts.table`) takes per layer range the fastest choice that fits,
so it needs every choice's memory at its position's microbatches in flight. What that
memory is made of (`StageCosts._held_memory`: the state, one microbatch's activations,
the workspace) does not depend on the position, only how many microbatches it holds
does; so the parts are stacked once per stage and microbatch size, and each table's
memory is a few array operations over the stack, not one `variant` per choice (on an
80-layer model, most of a table's time).

The sums are `solver.memory`'s own (`activation_parts`, then `DeviceMemory.total`'s
state + activations + workspace), in the same order: each figure is `variant`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, NamedTuple

import numpy as np

from solver.cost.ranges import full
from solver.cost.stage_config import StageConfig
from solver.memory import activation_parts


class _Parts(NamedTuple):
    """Per choice (a row each, (choices, L+1, L+1)):
    total = state + (per_held * held' + once + working) + workspace, held' = 1 where fused."""

    state: np.ndarray  # parameters + gradients + optimizer state
    per_held: np.ndarray  # bytes per microbatch in flight
    once: np.ndarray
    working: np.ndarray
    workspace: np.ndarray
    fused: np.ndarray  # (choices, 1, 1) bool: forward and backward one program


class ChoiceMemory:
    """Bytes per device of every on-device choice of one stage, per held count."""

    # Stacks kept, the least recently used dropped: a stack is a few MiB on an 80-layer
    # model, and a stage's tables are mostly asked for together (on the 768-GPU
    # scenario 16 rebuild a quarter more stacks than keeping all 101, ~200 MiB).
    KEEP = 16

    def __init__(self, held_memory: Callable[..., tuple], layers: int):
        """`held_memory`: `StageCosts._held_memory`, the parts of one choice's memory;
        `layers`: the model's, so a stack has (layers + 1) squared entries per choice."""
        self.held_memory, self.layers = held_memory, layers
        self._parts: OrderedDict[tuple[StageConfig, int, bool, tuple[tuple[int, str], ...]], _Parts] = OrderedDict()

    def totals(self, cfg: StageConfig, b: int, held: int, last: bool, choices: list[tuple[int, str]]) -> np.ndarray:
        """(choices, L+1, L+1): each choice's bytes per device with `held` microbatches in
        flight and its optimizer state on the device, as `variant(...).memory.total`."""
        p = self._stacked(cfg, b, last, tuple(choices))
        count = np.where(p.fused, 1.0, float(held))
        return (p.state + (p.per_held * count + p.once + p.working)) + p.workspace

    def _stacked(self, cfg: StageConfig, b: int, last: bool, choices: tuple[tuple[int, str], ...]) -> _Parts:
        key = (cfg, b, last, choices)
        if key in self._parts:
            self._parts.move_to_end(key)
        else:
            if len(self._parts) >= self.KEEP:
                self._parts.popitem(last=False)
            shape = (self.layers + 1, self.layers + 1)
            rows = []
            for zero, remat in choices:
                state, activations, fused, workspace = self.held_memory(cfg, b, last, zero, remat, 0.0)
                per_held, once, working = activation_parts(activations, remat, fused)
                rows.append((state.state, per_held, once, working, state.workspace + workspace, fused))
            columns = list(zip(*rows))
            self._parts[key] = _Parts(*(np.stack([full(v, shape) for v in column]) for column in columns[:5]),
                                      np.array(columns[5], dtype=bool)[:, None, None])
        return self._parts[key]
