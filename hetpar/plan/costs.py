"""A Plan priced by the one estimator (`solver.cost.estimate`).

A plan carries its cost inputs (`Plan.cost_inputs`: the traced step's layers and the
cluster's device kinds and links as the planner's `Problem`), never trusted
predictions: `priced` reads the plan's decisions (layers, devices, mesh, ZeRO,
recomputation, schedule, microbatches, replicas) and writes the estimator's figures
into it, and every view (`hetpar solve`, `show`, `simulate`, `compare`, the API)
prints what `estimate_plan` says. A plan loaded from a file is priced again the
same way, so an edited figure in a file changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hetpar.errors import PlanError
from hetpar.plan.model import Plan, StagePlan
from solver.cost.problem import PlanningError
from solver.cost.estimate import Decisions, PlanCost, StageDecision, estimate
from solver.cost.model_axes import ModelCollective


def decisions(plan: Plan, dots_bytes: dict[int, float] | None = None) -> Decisions:
    """The choices of `plan` (which has cost inputs) as the estimator reads them. A
    stage runs on its cluster group's device kind (the cost inputs name kinds by
    group) with its mesh's data and model axes, on two model axes the collectives its
    layouts run (`StagePlan.model_collectives`), a mixed stage's part with its lead's
    position and its examples per microbatch; `dots_bytes` (per stage index, per
    example): what a "dots" recomputation keeps."""
    dots_bytes = dots_bytes or {}
    position = {s.index: p for p, s in enumerate(plan.stages)}
    stages = tuple(
        StageDecision(s.group or s.device_type, *_mesh(s), s.layer_start, s.layer_end, s.remat, s.zero, s.replica,
                      dots_bytes.get(s.index, 0.0), s.offload, s.zero_group,
                      model_collectives=tuple(ModelCollective(*c) for c in s.model_collectives),
                      part_of=position.get(s.part_of, len(plan.stages)) if s.is_part else -1, examples=s.examples)
        for s in plan.stages
    )
    batch = plan.replica_batch or (plan.cost_inputs.batch_size,)
    return Decisions(stages, plan.num_microbatches, plan.schedule, tuple(batch), plan.chunks)


def _mesh(stage: StagePlan) -> tuple[int, int]:
    """(data, model) sizes of the stage's mesh; a 3-axis mesh's two model axes
    together are its tensor-parallel degree."""
    shape = stage.mesh_shape or (stage.num_devices,)
    return (shape[0], math.prod(shape[1:]))


def estimate_plan(plan: Plan, dots_bytes: dict[int, float] | None = None) -> PlanCost:
    """The estimator's price of `plan` (its `cost_inputs`, its decisions)."""
    if plan.cost_inputs is None:
        raise PlanError("the plan has no cost inputs to price it with; solve it again with this hetpar")
    try:
        return estimate(plan.cost_inputs, decisions(plan, dots_bytes))
    except PlanningError as e:
        raise PlanError(f"the plan does not match its cost inputs: {e}; solve it again") from None


def priced(plan: Plan, dots_bytes: dict[int, float] | None = None) -> Plan:
    """`plan` with the estimator's figures written into its stages and step: what
    views print and what the fit check reads. A plan without cost inputs (written by
    hand) comes back unpriced, every figure 0."""
    if plan.cost_inputs is None:
        return unpriced(plan)
    cost = estimate_plan(plan, dots_bytes)
    m = plan.num_microbatches
    stages = tuple(
        replace(s, forward_s=c.forward_s, backward_s=c.backward_s, send_s=c.send_s, sync_s=c.sync_s,
                optimizer_s=c.optimizer_s, predicted_time_s=m * (c.forward_s + c.backward_s),
                memory_bytes=int(c.group_memory_bytes), memory_capacity=c.capacity, host_bytes=int(c.group_host_bytes),
                nvme_bytes=int(c.group_nvme_bytes))
        for s, c in zip(plan.stages, cost.stages)
    )
    return replace(plan, stages=stages, predicted_step_time_s=cost.step_s, model_flops=cost.model_flops,
                   peak_flops=cost.peak_flops, tokens_per_step=cost.tokens_per_step)


def unpriced(plan: Plan) -> Plan:
    """`plan` with every predicted figure cleared: what a plan without cost inputs
    honestly says."""
    stages = tuple(replace(s, forward_s=0.0, backward_s=0.0, send_s=0.0, sync_s=0.0, optimizer_s=0.0, predicted_time_s=0.0,
                           memory_bytes=0, host_bytes=0, nvme_bytes=0) for s in plan.stages)
    return replace(plan, stages=stages, predicted_step_time_s=0.0)


def fit_problems(plan: Plan, cost: PlanCost) -> list[str]:
    """Each device group the plan overflows, in words with its memory by what holds it."""
    out = []
    seen: set[tuple[int, ...]] = set()
    for p in cost.overflows():
        s, c = plan.stages[p], cost.stages[p]
        if not c.fits_host:
            out.append(f"stage {s.index} keeps {_bytes(c.group_host_bytes)} of optimizer state per device in host memory, "
                       f"and each {s.device_type}'s share of its node's host memory is {_bytes(c.host_capacity)}"
                       + ("" if c.host_capacity else " (unknown: give host_memory_gib in the cluster file's group)")
                       + "; to fit: more host memory (host_memory_gib), ZeRO over more data-parallel devices (each keeps "
                       "its share), or offload fewer stages (StageOption.offload=None lets the planner choose)")
        if not c.fits_nvme:
            out.append(f"stage {s.index} keeps {_bytes(c.group_nvme_bytes)} of optimizer state per device on its node's disk, "
                       f"and each {s.device_type}'s share of it is {_bytes(c.nvme_capacity)}"
                       + ("" if c.nvme_capacity else " (none declared: give nvme_gib in the cluster file's group)")
                       + "; to fit: a larger disk (nvme_gib), ZeRO over more data-parallel devices, or offload='host'")
        if c.fits_device:
            continue
        if s.device_ids in seen:
            continue
        seen.add(s.device_ids)
        chunks = [q for q, other in enumerate(plan.stages) if other.device_ids == s.device_ids]
        parts = ", ".join(f"{name} {value / 2**30:.2f}" for name, value in _categories([cost.stages[q] for q in chunks]))
        who = f"stage {s.index}" if len(chunks) == 1 else f"stages {', '.join(str(plan.stages[q].index) for q in chunks)} (one device group)"
        kind = plan.cost_inputs.kind(s.group or s.device_type) if plan.cost_inputs else None
        memory = kind.memory_bytes if kind else c.capacity
        out.append(f"{who} needs {c.group_memory_bytes / 2**30:.2f} GiB per {s.device_type}, which has {memory / 2**30:.0f} GiB "
                   f"({c.capacity / 2**30:.2f} GiB to use beside XLA's workspace{_client_share(plan, kind, c)}): {parts} GiB")
    return out


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.3g} MiB"


def _client_share(plan: Plan, kind, cost) -> str:  # noqa: ANN001
    """Where the JAX client's memory share is what stops the stage: the numbers and
    the setting that would let it fit (`hetpar.cluster.memory`)."""
    if kind is None or (kind.memory_fraction >= 1 and not kind.process_reserve_bytes):
        return ""
    gib, keep = 2**30, 1 - plan.cost_inputs.memory_reserve
    said = (f", after the JAX client's {kind.memory_fraction:.0%} of the device (XLA_PYTHON_CLIENT_MEM_FRACTION="
            f"{kind.memory_fraction:g}) less a {kind.process_reserve_bytes / gib:.2f} GiB per-process reserve")
    needed = (cost.group_memory_bytes / keep + kind.process_reserve_bytes) / kind.memory_bytes
    if needed <= 1:
        said += (f"; it would fit at XLA_PYTHON_CLIENT_MEM_FRACTION={min(1.0, math.ceil(needed * 100) / 100):.2f} in the environment the "
                 f"plan runs in (or memory_fraction in the cluster file's group)")
    return said


def _categories(costs: list) -> list[tuple[str, float]]:  # noqa: ANN001
    names = ("parameters", "gradients", "optimizer_state", "activations", "workspace")
    return [(n.replace("_", " "), sum(getattr(c.memory, n) for c in costs)) for n in names]
