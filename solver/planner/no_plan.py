"""What the planner says when it finds no plan: the cause (no pipeline shape runs under
the allowed schedules, the state exceeds the cluster's memory, or no split keeps each
device within its own) and the fixes that would let one fit."""

from __future__ import annotations

import math

from solver import schedules as registry
from solver.cost.problem import memory_note
from solver.cost.stage_costs import StageCosts
from solver.planner.problem import Problem


def why_nothing_fits(p: Problem, costs: StageCosts, schedules: list[tuple[str, int]]) -> str:
    """Why the search found no plan (`schedules`: the (schedule, chunks) pairs it tried),
    and what would fix it: no shape runs, the state exceeds the cluster's memory, or no
    split keeps each device within its own."""
    blocked = why_no_shape_runs(p, costs, schedules)
    if blocked:
        return blocked
    offload = all(costs.offload.allowed(k) for k in p.kinds)  # the optimizer state may leave the devices
    need = float(costs.params.sum()) * (2.0 if offload else p.state_factor)
    have = sum(k.count * k.usable_bytes * (1 - p.memory_reserve) for k in p.kinds)
    gib = 2**30
    if need > have:
        notes = "".join(f" ({n})" for n in (memory_note(k) for k in p.kinds) if n)
        held = "parameters and gradients (the optimizer state off the devices)" if offload else \
            "parameters, gradients and optimizer state"
        if not offload and "host" in p.offload_tiers:
            notes += ("; with host_memory_gib in the cluster file's groups the optimizer state could be kept in host "
                      "memory") if not any(k.host_memory_bytes for k in p.kinds) else ""
        return (f"no plan fits: {held} need {need / gib:.1f} GiB and the cluster has "
                f"{have / gib:.1f} GiB in all{notes}; add devices (at least {math.ceil(need / have * sum(k.count for k in p.kinds))} "
                "like these in all) or use a smaller model")
    fixes = []
    if not p.allow_remat:
        fixes.append("allow rematerialization")
    if max(p.microbatch_counts()) < p.batch_size:
        fixes.append("allow more microbatches (smaller microbatches keep fewer activations)")
    fixes += ["add devices", "use a smaller batch"]
    notes = [n for n in (memory_note(k) for k in p.kinds) if n]
    if notes:
        fixes.append("raise the memory the JAX client may use (" + "; ".join(notes) + ")")
    if p.training and any(k.host_memory_bytes for k in p.kinds):  # the optimizer state could go to local disks
        if "nvme" not in p.offload_tiers and "host" in p.offload_tiers:
            fixes.append("allow offload='nvme' (the optimizer state on local disks where host memory is short)")
        elif "nvme" in p.offload_tiers and not any(k.nvme_bytes for k in p.kinds):
            fixes.append("give nvme_gib in the cluster file's groups (the optimizer state on local disks where host "
                         "memory is short)")
    return (f"no plan fits in memory: the state fits in the cluster's {have / gib:.1f} GiB, but no split of the layers keeps "
            f"every device's state and activations within its memory; to fit: {', '.join(fixes)}")

def why_no_shape_runs(p: Problem, costs: StageCosts, schedules: list[tuple[str, int]]) -> str | None:
    """Why no pipeline of any shape can run under the allowed schedules, whatever
    memory says (None: some shape can): an interleaved schedule needs at least one
    layer per virtual stage, at least two device groups and (Megatron's order) a
    microbatch count that is a multiple of them. Each schedule's own `check` says
    what it refuses; this asks it of every device group count the layers allow."""
    devices = sum(k.count for k in p.kinds)
    counts = [m for m in p.microbatch_counts() if p.batch_size // m >= p.min_microbatch] or p.microbatch_counts()
    reasons = []
    for name, chunks in schedules:
        most = min(devices, costs.n // chunks)  # device groups: a stage holds one layer at least
        if most < 1:
            why = f"{chunks} chunks need at least {chunks} layers"
        else:
            checked = [registry.get(name).check(d, m, chunks) for d in range(most, 0, -1) for m in reversed(counts)]
            if not all(checked):
                return None
            why = checked[0]
        if most < devices and not all(registry.get(name).check(d, m, chunks) for d in range(most + 1, devices + 1)
                                      for m in counts):
            why += (f" (the step's {costs.n} planning layers allow at most {most} device group(s) of {chunks} "
                    "chunks, a stage holding one layer at least)")
        reasons.append(f"{name} with {chunks} chunks per device group: {why}")
    return ("no pipeline can run under the allowed schedules: " + "; ".join(reasons)
            + "; plan with more layers, fewer chunks per device group, another microbatch count, or another schedule")
