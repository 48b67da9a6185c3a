"""What a plan decides, as the cost model reads it: per stage its kind, data and
tensor parallelism, layers, recomputation, ZeRO, replica, offload tier, hybrid group,
3-axis collectives and mixed-stage part; the microbatches, schedule, chunks and each
replica's examples. Plain numbers, made from a Plan (hetpar/plan/costs.py) or a
planner's choice (solver/planner/step.py), priced by `solver.cost.estimate`."""

from __future__ import annotations

from dataclasses import dataclass

from solver.cost.model_axes import ModelCollective
from solver.cost.stage_config import StageConfig


@dataclass(frozen=True)
class StageDecision:
    """One (virtual) stage: `dp x tp` devices of the problem's kind `kind` running
    layers [layer_start, layer_end) of pipeline `replica`."""

    kind: str
    dp: int
    tp: int
    layer_start: int
    layer_end: int
    remat: str = ""  # "", "full" or "dots" (solver.memory.REMAT_POLICIES)
    zero: int = 0
    replica: int = 0
    dots_bytes: float = 0.0  # per example: the matmul results a "dots" stage keeps besides its input
    offload: str = ""  # where its optimizer state lives between steps: "" its devices, "host" host memory, "nvme" disk
    zero_group: int = 0  # hybrid sharding: ZeRO over this many of the data axis's devices (a node's); 0: all
    # A stage whose tensor parallelism spans two model axes: the collectives its layouts run (solver.cost.model_axes)
    model_collectives: tuple[ModelCollective, ...] = ()
    # A part of a mixed-kind stage (solver/cost/mixed.py): the position in `Decisions.stages`
    # of the stage's lead (-1: the stage is its own, or the lead), and the examples of
    # each microbatch this part takes (0: the whole microbatch; set on the lead too).
    part_of: int = -1
    examples: int = 0

    @property
    def config(self) -> StageConfig:
        """The stage as the cost tables see it."""
        return StageConfig(self.kind, self.dp, self.tp, self.zero_group, self.model_collectives)

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class Decisions:
    """What a plan decides, as numbers: its stages (each replica's in pipeline order),
    microbatches, schedule, chunks per device group and examples per replica."""

    stages: tuple[StageDecision, ...]
    num_microbatches: int
    schedule: str
    replica_batch: tuple[int, ...]
    chunks: int = 1

    def replica_stages(self, replica: int) -> list[StageDecision]:
        """Replica `replica`'s pipeline positions in order (a mixed stage by its lead)."""
        return [s for s in self.stages if s.replica == replica and s.part_of < 0]

    def parts(self, lead: int) -> list[StageDecision]:
        """The parts of the stage at position `lead`, lead first; [] when it is not mixed."""
        mine = [s for s in self.stages if s.part_of == lead]
        return [self.stages[lead], *mine] if mine else []
