"""What a stage's prices are made of: per layer (`PerLayer`), per ZeRO stage and
recomputation choice over every layer range (`StageVariant`), and the table the search
reads, the fastest choice that fits per range (`StageTable`). Apart from the arithmetic
that fills them (`solver.cost.stage_costs`), so a reader of a table needs only this."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from solver.memory import DeviceMemory


@dataclass(frozen=True)
class PerLayer:
    """Per layer, on one device of a stage, for one microbatch."""

    forward: np.ndarray  # seconds
    backward: np.ndarray
    state: np.ndarray  # bytes of parameters, gradients and optimizer state
    saved: np.ndarray  # bytes of activations kept for the backward
    inputs: np.ndarray  # bytes of the layer's input (all that remat keeps)
    recomputed: np.ndarray  # bytes of `saved` a backward rerunning the forward holds (solver.memory)
    rerun: np.ndarray  # seconds a backward that recomputes adds: the forward again, or as measured
    # seconds of the forward and backward as one program, as the pipeline's last stage runs them (XLA fuses
    # across the two): as measured (`LayerPrice.fused_s`), else the two above
    fused: np.ndarray | None = None


@dataclass(frozen=True)
class StageVariant:
    """One stage under one ZeRO stage and recomputation policy, for all layer ranges
    [i, j): per microbatch forward and backward seconds, memory per device by what
    holds it (`solver.memory.DeviceMemory` of arrays), the once-per-step tail and its
    gradient sync."""

    forward: np.ndarray
    backward: np.ndarray
    memory: DeviceMemory
    tail: np.ndarray
    sync: np.ndarray
    hidden: np.ndarray | float = 0.0  # seconds of the once-per-step reduction run under the last backward (not in `tail`)


@dataclass(frozen=True)
class StageTable:
    """Everything about one stage position, for all layer ranges [i, j) (i < j), with
    the fastest ZeRO stage and recomputation choice that fits chosen per range."""

    forward: np.ndarray  # (L+1, L+1) seconds per microbatch, inf where the range does not fit
    backward: np.ndarray
    remat: np.ndarray  # bool: the range recomputes its forward ("full")
    memory: np.ndarray  # bytes per device (solver.memory)
    tail: np.ndarray  # gradient sync + optimizer, seconds per step
    sync: np.ndarray
    capacity: int
    zero: np.ndarray | None = None  # int: the range's ZeRO stage; None: 0 everywhere
    offload: np.ndarray | None = None  # int: the range's place in solver.memory.OFFLOAD_TIERS; None: "" everywhere

    @cached_property
    def time(self) -> np.ndarray:
        return self.forward + self.backward

    @cached_property
    def run_times(self) -> np.ndarray:
        """The distinct times of the ranges that run (finite), ascending: the bottlenecks
        a split over this stage can have (`layer_split.best_split`), sorted once per table
        rather than per pipeline that reads it."""
        return np.unique(self.time[np.isfinite(self.time)])

    @cached_property
    def run_tails(self) -> np.ndarray:
        """The distinct tails of the ranges that run, ascending (`run_times`' tails)."""
        return np.unique(self.tail[np.isfinite(self.time)])

    @cached_property
    def least_time(self) -> float:
        """The least time of any range (inf where none runs): a floor on the stage's
        time in any split (`layer_split._Row.pace_floor`), taken once per table."""
        return self.time.min()

    @cached_property
    def least_rate(self) -> float:
        """The least time per layer of any range (inf where none runs): no range this
        stage holds runs faster per layer (`layer_split._Row.pace_floor`)."""
        positions = np.arange(self.time.shape[0])
        length = positions[None, :] - positions[:, None]
        return np.where(length > 0, self.time / np.maximum(length, 1), np.inf).min()
