"""Pricing a configuration the user fixes by hand ("what would Megatron's setup give
here?"), with the same cost model the planner searches with.

A manual configuration is one pipeline of `pp` device groups of one kind, each
`dp x tp` devices, running microbatches of `microbatch` examples per data-parallel
replica (Megatron's micro-batch size) under a schedule, optionally with every
layer's forward recomputed in the backward. Layers are split evenly over the
`pp x chunks` virtual stages, as Megatron splits them (`even_cuts`). It is priced by
the estimator (`solver.cost.estimate`), as every plan is.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver import schedules
from solver.cost.estimate import Decisions, PlanCost, StageDecision, estimate
from solver.planner.problem import PlanChoice, PlanningError, Problem, StageChoice
from solver.schedules.one_f_one_b import OneFOneB


@dataclass(frozen=True)
class ManualConfig:
    tp: int
    pp: int
    dp: int
    microbatch: int = 1  # examples per microbatch on each data-parallel replica
    schedule: str = OneFOneB.name
    chunks: int = 1  # stages per device group (interleaved schedules)
    remat: bool = False  # recompute every forward in the backward (Megatron's full recomputation)
    kind: str | None = None  # device kind; None: the problem's only kind (or its first)

    @staticmethod
    def parse(text: str) -> "ManualConfig":
        """`tp=8,pp=8,dp=4,mb=1,schedule=interleaved,chunks=2,remat=full,kind=A100`."""
        fields: dict = {}
        names = {"tp": "tp", "pp": "pp", "dp": "dp", "mb": "microbatch", "microbatch": "microbatch", "schedule": "schedule",
                 "chunks": "chunks", "remat": "remat", "kind": "kind"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in names or not value:
                raise PlanningError(f"manual configuration {text!r}: {part!r} is not key=value with a key among "
                                    f"{', '.join(sorted(set(names)))}; e.g. tp=8,pp=8,dp=4,mb=1,schedule=1f1b,remat=full")
            field_name, value = names[key], value.strip()
            if field_name in ("tp", "pp", "dp", "microbatch", "chunks"):
                if not value.isdigit() or int(value) < 1:
                    raise PlanningError(f"manual configuration {text!r}: {key} must be a positive whole number, got {value!r}")
                fields[field_name] = int(value)
            elif field_name == "remat":
                if value.lower() not in ("full", "none", "true", "false", "1", "0"):
                    raise PlanningError(f"manual configuration {text!r}: remat is 'full' or 'none', got {value!r}")
                fields["remat"] = value.lower() in ("full", "true", "1")
            else:
                fields[field_name] = value
        missing = [k for k in ("tp", "pp", "dp") if k not in fields]
        if missing:
            raise PlanningError(f"manual configuration {text!r} needs {', '.join(missing)} (e.g. tp=8,pp=8,dp=4)")
        if "chunks" not in fields and fields.get("schedule") in schedules.names():
            fields["chunks"] = schedules.get(fields["schedule"]).default_chunks
        return ManualConfig(**fields)

    def describe(self) -> str:
        schedule = f"{self.schedule} x{self.chunks}" if self.chunks > 1 else self.schedule
        return f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.microbatch} {schedule}{' remat' if self.remat else ''}"


def price(problem: Problem, config: ManualConfig) -> PlanChoice:
    """The manual configuration's plan and simulated step time under `problem`'s cost
    model; a PlanningError naming what is wrong when it cannot run or does not fit."""
    kind_name = config.kind or problem.kinds[0].name
    if kind_name not in {k.name for k in problem.kinds}:
        raise PlanningError(f"manual configuration {config.describe()}: no device kind {kind_name!r}; "
                            f"known: {', '.join(k.name for k in problem.kinds)}")
    kind = problem.kind(kind_name)
    devices = config.tp * config.pp * config.dp
    if devices > kind.count:
        raise PlanningError(f"manual configuration {config.describe()} needs {devices} {kind_name} devices; there are {kind.count}")
    if config.tp > kind.devices_per_node or kind.devices_per_node % config.tp:
        raise PlanningError(f"manual configuration {config.describe()}: tp={config.tp} must divide the {kind.devices_per_node} "
                            f"devices of a {kind_name} node (tensor parallelism stays inside a node)")
    if config.schedule not in schedules.names():
        raise PlanningError(f"unknown schedule {config.schedule!r}; known: {', '.join(schedules.names())}")
    b = config.microbatch * config.dp  # examples per pipeline microbatch
    if problem.batch_size % b:
        raise PlanningError(f"manual configuration {config.describe()}: the batch of {problem.batch_size} is not a whole number "
                            f"of microbatches of {config.microbatch} x {config.dp} replicas = {b} examples")
    m = problem.batch_size // b
    why = schedules.get(config.schedule).check(config.pp, m, config.chunks)
    if why:
        raise PlanningError(f"manual configuration {config.describe()}: {why}")
    stages = config.pp * config.chunks
    n = len(problem.layers)
    if stages > n:
        raise PlanningError(f"manual configuration {config.describe()}: {stages} stages need at least {stages} layers; the model has {n}")
    cuts = even_cuts(n, stages)
    bounds = list(zip([0, *cuts], [*cuts, n]))
    remat = "full" if config.remat else ""
    chosen = Decisions(tuple(StageDecision(kind_name, config.dp, config.tp, i, j, remat) for i, j in bounds), m,
                       config.schedule, (problem.batch_size,), config.chunks)
    cost = estimate(problem, chosen)
    if not cost.fits:
        worst = max(cost.overflows(), key=lambda p: cost.stages[p].group_memory_bytes)
        i, j = bounds[worst]
        need, capacity = cost.stages[worst].group_memory_bytes, cost.stages[worst].capacity
        where = f"stage {worst} (layers {i}-{j - 1})" if config.chunks == 1 else f"the device group of stage {worst}"
        raise PlanningError(f"manual configuration {config.describe()} does not fit: {where} needs "
                            f"{need / 2**30:.1f} GiB per device, a {kind_name} has {capacity / 2**30:.1f} GiB to use"
                            + ("" if config.remat else "; try remat=full") + ", more pipeline stages or tensor parallelism")
    return choice_of(problem, cost)


def choice_of(problem: Problem, cost: PlanCost) -> PlanChoice:
    """A priced plan as the planner's choices are written (what `compare` lists); a
    stage's memory is its device group's (all its chunks), what must fit."""
    d = cost.decisions
    stages = tuple(
        StageChoice(s.kind, s.dp, s.tp, s.layer_start, s.layer_end, bool(s.remat), c.forward_s, c.backward_s, c.send_s,
                    c.sync_s - cost.cross_sync_s, c.optimizer_s, int(c.group_memory_bytes), c.capacity, s.replica, s.zero,
                    s.offload)
        for s, c in zip(d.stages, cost.stages)
    )
    return PlanChoice(stages, d.num_microbatches, d.schedule, cost.step_s, d.replica_batch, cost.cross_sync_s,
                      cost.tokens_per_step, cost.model_flops, cost.peak_flops, d.chunks)


def even_cuts(layers: int, stages: int) -> tuple[int, ...]:
    """Layers split as evenly as whole layers allow, the first stages taking the one
    extra layer where the count does not divide (the last stage also carries the
    output layer and loss, the heaviest)."""
    sizes = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    return tuple(sum(sizes[:s]) for s in range(1, stages))
