"""What the planner returns, as plain data. What it is given (`Problem`: layers and
device kinds) is the cost model's input, `solver.cost.problem`."""

from __future__ import annotations

from dataclasses import dataclass, field

from solver.cost.problem import DeviceKind, LayerCost, PlanningError, Problem

__all__ = ["DeviceKind", "LayerCost", "PlanChoice", "PlanningError", "Problem", "SearchResult", "StageChoice"]


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: a group of `dp * tp` devices of one kind and a range of layers."""

    kind: str
    dp: int
    tp: int
    layer_start: int
    layer_end: int
    remat: bool
    forward_s: float  # one microbatch
    backward_s: float
    send_s: float  # to the next stage, one microbatch (0 on the last)
    sync_s: float  # gradient all-reduce over the stage's data-parallel devices
    optimizer_s: float
    memory_bytes: int  # per device
    memory_capacity: int
    replica: int = 0
    zero: int = 0  # ZeRO stage over the data-parallel devices (solver.memory)
    offload: str = ""  # where its optimizer state lives: "" its devices, "host" host memory (solver.memory.OFFLOAD_TIERS)
    # A mixed-kind stage's part (solver/planner/mixed.py): the position in `PlanChoice.stages`
    # of its lead (-1: a stage of its own, or the lead) and its rows of each microbatch (0: all).
    part_of: int = -1
    examples: int = 0

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class PlanChoice:
    stages: tuple[StageChoice, ...]
    num_microbatches: int
    schedule: str
    step_s: float
    replica_batch: tuple[int, ...]  # examples per replica (one entry: a single pipeline)
    cross_sync_s: float = 0.0  # gradient sum across replicas
    tokens_per_step: int = 0
    model_flops: float = 0.0  # per step, without rematerialization
    peak_flops: float = 0.0  # of the devices the plan uses
    chunks: int = 1  # stages per device group (interleaved schedules); stage p runs on group p mod (stages / chunks)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def throughput(self) -> float:
        """Examples per second."""
        return sum(self.replica_batch) / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.peak_flops if self.peak_flops else 0.0

    def parts(self, lead: int) -> list[StageChoice]:
        """The parts of the stage at position `lead`, lead first; [] when it is not mixed."""
        mine = [s for s in self.stages if s.part_of == lead]
        return [self.stages[lead], *mine] if mine else []

    @property
    def mixed(self) -> bool:
        """Whether a stage's data-parallel parts are of different kinds."""
        return any(s.part_of >= 0 for s in self.stages)

    @staticmethod
    def _stage_text(s: StageChoice) -> str:
        return (f"{s.kind} dp{s.dp}tp{s.tp} L{s.layer_start}-{s.layer_end - 1}{' remat' if s.remat else ''}"
                f"{f' zero{s.zero}' if s.zero else ''}{f' offload:{s.offload}' if s.offload else ''}"
                f"{f' [{s.examples} rows]' if s.examples else ''}")

    @property
    def num_devices(self) -> int:
        return sum(s.devices for s in self.stages)

    def describe(self) -> str:
        parts = []
        for r, share in enumerate(self.replica_batch):
            stages = [(p, s) for p, s in enumerate(self.stages) if s.replica == r and s.part_of < 0]
            body = " | ".join(" + ".join(self._stage_text(q) for q in self.parts(p) or [s]) for p, s in stages)
            parts.append(f"[{share} ex] {body}" if len(self.replica_batch) > 1 else body)
        schedule = f"{self.schedule} x{self.chunks}" if self.chunks > 1 else self.schedule
        return f"{schedule} m={self.num_microbatches}: " + " || ".join(parts)


@dataclass(frozen=True)
class SearchResult:
    best: PlanChoice
    alternatives: tuple[PlanChoice, ...]  # next best, in order
    upper_bound: float  # examples/s: sum over kinds of the best plan on that kind alone
    search_s: float
    per_kind: tuple[tuple[str, float], ...] = field(default=())  # examples/s of each kind alone
    gap: float = 0.0  # 0: proven best under the model; else the best possible may be this fraction faster
    # Wall seconds of each part of `search_s`, in the order they ran: the search of
    # pipelines, of pipelines side by side ("replicas"), the estimator's ranking of the
    # finalists, mixed-kind stages, and each kind's own search for the bound.
    phases: tuple[tuple[str, float], ...] = field(default=())

    def describe_phases(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)

    @property
    def bound_ratio(self) -> float | None:
        """Throughput over the bound; None where no kind alone fits the model (a 70B
        model on any one kind of the cluster), so there is no bound to compare with."""
        return self.best.throughput / self.upper_bound if self.upper_bound else None
