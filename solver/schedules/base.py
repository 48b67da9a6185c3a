"""What a pipeline schedule is, as plain data and one abstract type.

A schedule decides, for every device group of a pipeline, the order in which it runs
forward and backward work (`device_order`); how many microbatches' activations each
stage keeps at once (`in_flight`, what the memory model charges); and the closed form
of its step time (`step_time`, what the planner scores splits with). The simulator
(`solver.pipeline_sim`) runs any schedule from its orders, so a new schedule is one
module defining these and one `register` call.

Stages are *virtual* stages in pipeline order. With `chunks` = v > 1 (interleaved
schedules) a pipeline of D device groups has D x v stages and stage s runs on device
group s mod D, as chunk s // D: non-adjacent slices of the layers share devices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StageTimes:
    forward_s: float  # one microbatch
    backward_s: float  # one microbatch; 0 on a stage whose forward program also runs the backward
    send_s: float = 0.0  # one microbatch's activation to the next stage (its gradient comes back as fast)
    sync_s: float = 0.0  # gradient synchronisation across data-parallel replicas, once per step
    optimizer_s: float = 0.0  # once per step
    overlapped_s: float = 0.0  # the step's gradient reduction run under the last backward: drawn, never waited on


@dataclass(frozen=True)
class Work:
    """One unit of a device group's order: a forward or backward of one microbatch
    through one of its chunks."""

    kind: str  # "F" | "B"
    chunk: int
    microbatch: int

    def stage(self, device: int, num_devices: int) -> int:
        """The virtual stage this work runs: chunk c of device d is stage c*D + d."""
        return self.chunk * num_devices + device


class Schedule(ABC):
    """One pipeline schedule. Subclasses set `name` and implement the orders, the
    activations in flight and the closed form; `check` refuses shapes they cannot run."""

    name: str = ""
    interleaved: bool = False  # runs several chunks per device group
    default_chunks: int = 1  # chunks per device group when a hand-made plan names none
    # A schedule never smaller than this one and, under the planner's model, faster only
    # in corners it does not search (each says which): a search that may pick both tries
    # only the other.
    dominated_by: str | None = None
    # Whether the first stage's in-flight limit paces it (`round_trip_pace`): the planner's
    # bounds and splits add that pace for such a schedule only.
    round_trip_limited: bool = False

    def check(self, num_devices: int, num_microbatches: int, chunks: int) -> str | None:
        """Why this schedule cannot run D device groups x `chunks` over m microbatches
        (None: it can). The default accepts one chunk per device group."""
        if chunks != 1:
            return f"{self.name} runs one chunk per device group, got chunks={chunks}; use the 'interleaved' schedule for more"
        return None

    def validate(self, num_devices: int, num_microbatches: int, chunks: int) -> None:
        if num_devices < 1 or num_microbatches < 1 or chunks < 1:
            raise ValueError("a pipeline needs at least one device group, one microbatch and one chunk")
        why = self.check(num_devices, num_microbatches, chunks)
        if why:
            raise ValueError(why)

    @abstractmethod
    def device_order(self, device: int, num_devices: int, num_microbatches: int, chunks: int = 1) -> list[Work]:
        """The forwards and backwards device group `device` runs, in order."""

    @abstractmethod
    def in_flight(self, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
        """Microbatches whose activations stage `position` (of `num_stages` virtual
        stages) keeps at once."""

    @abstractmethod
    def step_time(self, stages: Sequence[StageTimes], num_microbatches: int, chunks: int = 1) -> float:
        """The closed-form step time of these virtual stages, for searches too large
        to simulate every candidate."""


def device_totals(stages: Sequence[StageTimes], chunks: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per device group (virtual stage s on group s mod D): the sum over its chunks of
    forward, backward, outgoing send and tail (sync + optimizer) times."""
    d = len(stages) // chunks
    fwd, bwd, send, tail = [0.0] * d, [0.0] * d, [0.0] * d, [0.0] * d
    for s, t in enumerate(stages):
        fwd[s % d] += t.forward_s
        bwd[s % d] += t.backward_s
        if s + 1 < len(stages):
            send[s % d] += t.send_s
        tail[s % d] += t.sync_s + t.optimizer_s
    return fwd, bwd, send, tail
