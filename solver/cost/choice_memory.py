"""A stage table's memory for every (ZeRO stage, recomputation) choice at once.

A stage table (`StageCosts.table`) takes per layer range the fastest choice that fits,
so it needs every choice's memory at its position's microbatches in flight. What that
memory is made of does not depend on the position, only how many microbatches it holds
does, and each part depends on less than the whole choice: the state and the workspace
on the ZeRO stage and the model and data axes alone (`held_state`: not on the
microbatch, nor on recomputation), one microbatch's activations on the stage, its
microbatch, its place (last or not) and the recomputation alone (`held_activations`:
not on the ZeRO stage). So a table's memory is the activations of each recomputation
at its held count, added to the states of every ZeRO stage in one broadcast, instead
of a stack of every choice's parts built per stage (on the search-scale scenarios,
half of a table's time).

The sums are `solver.memory`'s own (`activation_parts`, then `DeviceMemory.total`'s
state + activations + workspace), in the same order: each figure is `variant`'s, bit
for bit (`tests/test_stage_cost_sharing.py`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from solver.cost.ranges import full
from solver.cost.stage_config import StageConfig
from solver.memory import DeviceMemory, StageActivations, activation_parts

StageCosts = Any  # solver.cost.stage_costs.StageCosts, which builds on this module (so not imported here)


def held_state(costs: StageCosts, cfg: StageConfig, zero: int) -> tuple[DeviceMemory, np.ndarray | float]:
    """A choice's state per device (parameters, gradients, optimizer state) and its
    workspace (ZeRO-3: one layer's parameters gathered at a time), per layer range:
    the same for every microbatch, place and recomputation."""
    state = costs._state(costs._grads(cfg.tp), cfg.zero_shards, zero)
    return state, costs._params_max(cfg.tp) if zero >= 3 else 0.0


def held_activations(costs: StageCosts, cfg: StageConfig, b: int, last: bool, remat: str,
                     dots: float) -> tuple[StageActivations, bool]:
    """One microbatch's activations per device of stage `cfg` at `b` examples, per layer
    range, and whether forward and backward are one program (a pipeline's last stage):
    the same under every ZeRO stage."""
    _, _, saved, _, _ = costs._ranges(cfg, b)
    inputs = np.broadcast_to((costs.inputs * (b / cfg.dp / cfg.tp)).tolist() + [0.0], saved.shape).T  # a stage keeps its own input
    shard = b / cfg.dp / cfg.tp  # activations split over all the stage's devices
    activations = StageActivations(saved, inputs, dots=dots * b / cfg.dp / cfg.tp, largest=costs.largest_max * shard,
                                   recomputed=costs._recomputed_span * shard,
                                   rerun_working=costs.rerun_working_max * shard)
    if remat == "full" and costs.problem.layer_checkpoints:  # each layer's input kept, one layer rerun at a time
        activations = StageActivations(saved, costs._inputs_span * shard, largest=costs.largest_max * shard,
                                       recomputed=0.0, rerun_working=costs._layer_rerun_max * shard)
    return activations, one_program(costs, last, remat)


def one_program(costs: StageCosts, last: bool, remat: str) -> bool:
    """Whether a stage's forward and backward are one program, its microbatch's activations
    held once (`solver.memory.activation_parts`' `fused`): a pipeline's last stage, unless
    it reruns each layer from its kept input (`Problem.layer_checkpoints`): its program
    still frees each layer's activations."""
    return last and not (remat == "full" and costs.problem.layer_checkpoints)


@lru_cache(maxsize=None)
def choice_arrays(choices: tuple[tuple[int, str], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each choice's ZeRO stage and whether it recomputes, as arrays a table's picks index."""
    return np.array([z for z, _ in choices]), np.array([bool(r) for _, r in choices])


@lru_cache(maxsize=None)
def grid_of(choices: tuple[tuple[int, str], ...]) -> tuple[tuple[int, ...], tuple[str, ...], bool]:
    """The choices' ZeRO stages and recomputations, each once in order, and whether the
    choices are every pair of them, ZeRO stage major (a table's always are)."""
    zeros = tuple(dict.fromkeys(z for z, _ in choices))
    remats = tuple(dict.fromkeys(r for _, r in choices))
    return zeros, remats, list(choices) == [(z, r) for z in zeros for r in remats]


class RangeParts(NamedTuple):
    """One stage's memory at R entries (the layer ranges that exist alone, or every
    [i, j] flattened), per part, for its grid of (ZeRO stage, recomputation) choices:
    what `range_totals` adds."""

    state: np.ndarray  # (zeros, 1, R): each ZeRO stage's state
    workspace: np.ndarray  # (zeros, 1, R)
    per_held: np.ndarray  # (remats, R): each recomputation's bytes per microbatch in flight
    once: np.ndarray  # (remats, R)
    working: np.ndarray  # (remats, R)
    fused: tuple[bool, ...]  # per recomputation: forward and backward one program (one microbatch held)


def range_totals(parts: RangeParts, held: int, out: np.ndarray) -> None:
    """Each choice's bytes with `held` microbatches in flight, written into `out`
    (choices x R, contiguous), from parts stacked once per stage and place (a table adds
    five arrays, not a few per choice): `ChoiceMemory.totals`' one sum."""
    zeros, remats, ranges = len(parts.state), len(parts.fused), parts.state.shape[-1]
    if len(set(parts.fused)) == 1:  # one count for every recomputation
        counts: np.ndarray | float = 1.0 if parts.fused[0] else float(held)
    else:  # held' = 1 where forward and backward are one program, as `totals`
        counts = np.array([[1.0] if fused else [float(held)] for fused in parts.fused])
    activations = parts.per_held * counts  # per_held * held' + once + working
    activations += parts.once
    activations += parts.working
    body = np.reshape(out, (zeros, remats, ranges), copy=False)  # a view (an error, never a copy written to instead)
    np.add(parts.state, activations, out=body)
    body += parts.workspace  # (state + activations) + workspace, as `DeviceMemory.total` adds them


class ChoiceMemory:
    """Bytes per device of every on-device choice of one stage, per held count: over every
    [i, j] (`totals`), or over the layer ranges that exist alone (i < j, `ranges`; about
    half the entries: what the search's tables read, `solver.cost.device_table`)."""

    # Activation parts kept, the least recently used dropped: a stage's tables are mostly
    # asked for together, and each entry is three (layers + 1) squared arrays.
    KEEP = 256

    def __init__(self, costs: StageCosts):
        """`costs`: the stage tables whose `_held_state` and `_held_activations` (cached
        `held_state` and `held_activations`) the choices' memory is made of."""
        self.costs, self.layers = costs, costs.n
        self.shape = (costs.n + 1, costs.n + 1)
        self.ranges = np.flatnonzero(np.triu(np.ones(self.shape, dtype=bool), k=1))  # [i, j] with i < j, flattened
        self._states: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._parts = lru_cache(maxsize=self.KEEP)(self._parts_uncached)
        self._shared_parts = lru_cache(maxsize=self.KEEP)(self._shared_parts_uncached)
        # What `range_totals` adds for a stage, microbatch and place; None where the choices
        # are no grid (`totals` then prices them one by one). Cached: a stage's tables at
        # each held count add the same.
        self._stacks = lru_cache(maxsize=self.KEEP)(self._stacked_parts)

    def totals(self, cfg: StageConfig, b: int, held: int, last: bool, choices: list[tuple[int, str]],
               ranges: bool = False) -> np.ndarray:
        """(choices, L+1, L+1): each choice's bytes per device with `held` microbatches in
        flight and its optimizer state on the device, as `variant(...).memory.total`;
        `ranges`: (choices, len(self.ranges)), at the ranges that exist alone."""
        parts = self._stacks(cfg, b, last, tuple(choices), ranges)
        if parts is None:  # not a grid (the tables' always are): one by one
            return np.stack([self.totals(cfg, b, held, last, [choice], ranges)[0] for choice in choices])
        out = np.empty((len(choices), parts.state.shape[-1]))
        range_totals(parts, held, out)
        return out if ranges else out.reshape(len(choices), *self.shape)

    def range_parts(self, cfg: StageConfig, b: int, last: bool, choices: tuple[tuple[int, str], ...]) -> RangeParts | None:
        """What `totals(..., ranges=True)` adds, for a caller that adds it into its own array."""
        return self._stacks(cfg, b, last, choices, True)

    def _stacked_parts(self, cfg: StageConfig, b: int, last: bool, choices: tuple[tuple[int, str], ...],
                       ranges: bool) -> RangeParts | None:
        """`totals`' parts at the ranges or at every [i, j] (flattened), stacked; None where
        the choices are no grid."""
        zeros, remats, grid = grid_of(choices)
        if not grid:
            return None
        key = (cfg.tp, cfg.zero_shards, zeros, ranges)
        if key not in self._states:
            self._states[key] = self._stacked_states(cfg, zeros, ranges)
        parts = [self._parts(cfg, b, last, remat, ranges) for remat in remats]
        shape = (len(self.ranges),) if ranges else self.shape
        per_held, once, working = (np.stack([full(p[k], shape).reshape(-1) for p in parts]) for k in range(3))
        state, workspace = (x.reshape(len(zeros), 1, -1) for x in self._states[key])
        return RangeParts(state, workspace, per_held, once, working, tuple(p[3] for p in parts))

    def _at_ranges(self, values: np.ndarray | float, ranges: bool) -> np.ndarray | float:
        """`values` per [i, j] (an array or a number), or at the existing ranges alone."""
        if not ranges or not isinstance(values, np.ndarray):
            return values
        return full(values, self.shape).take(self.ranges)  # `take` flattens as `reshape(-1)` does

    def _stacked_states(self, cfg: StageConfig, zeros: tuple[int, ...], ranges: bool) -> tuple[np.ndarray, np.ndarray]:
        """(zeros, 1, ...) each ZeRO stage's state and workspace: they depend on the
        model axis and the devices the state is sharded over alone (`held_state`), so
        stages of every kind and microbatch with those share them."""
        rows = [self.costs._held_state(cfg, zero) for zero in zeros]
        state = np.stack([self._at_ranges(full(s.state, self.shape), ranges) for s, _ in rows])
        workspace = [self._at_ranges(full(s.workspace + w, self.shape), ranges) for s, w in rows]
        return state[:, None], np.stack(workspace)[:, None]

    def _parts_uncached(self, cfg: StageConfig, b: int, last: bool, remat: str, ranges: bool) -> tuple:
        """One recomputation's activation parts (`activation_parts`) and whether the
        stage's forward and backward are one program. One program's parts are those
        of no recomputation (what it keeps, held once), and a stage's activations are
        the same wherever it sits: so priced once per stage, microbatch and the parts'
        kind (`_shared_parts`), for every place and recomputation that has them."""
        fused = one_program(self.costs, last, remat)
        return (*self._shared_parts(cfg, b, "" if fused else remat, ranges), fused)

    def _shared_parts_uncached(self, cfg: StageConfig, b: int, remat: str, ranges: bool) -> tuple:
        """`_parts`' parts, not one program (a stage that is not the last: its activations
        are the last stage's too)."""
        activations, _ = self.costs._held_activations(cfg, b, False, remat, 0.0)
        return tuple(self._at_ranges(x, ranges) for x in activation_parts(activations, remat, False))
