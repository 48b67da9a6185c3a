"""What a stage's devices keep for their backward, as `solver.memory` counts it: one
question the placement's fit check and the sharding pass's memory budget both ask,
so the layout the sharding pass picks is judged by the figure placement checks."""

from __future__ import annotations

from hetpar.plan.model import Plan, StagePlan
from hetpar.trace.layers import Layers
from solver.memory import StageActivations, activation_bytes, in_flight


def stage_activations(stage: StagePlan, layers: Layers, plan: Plan, dots: int = 0) -> tuple[StageActivations, int, bool]:
    """Per device and microbatch, the stage's activations (`dots`: the full batch's
    matmul results a "dots" stage keeps); the microbatches it holds at once at its
    position in its own pipeline; whether it is its pipeline's last stage (forward and
    backward in one program). The layers' activations are split over all the stage's
    devices (the model axis shards the wide ones too, as the planner assumes)."""
    stages = plan.replica_stages(stage.replica)
    position = [s.index for s in stages].index(stage.index)
    held = in_flight(plan.schedule, plan.num_microbatches, position, len(stages), plan.chunks)
    per_device = stage.batch_share / plan.num_microbatches / max(stage.num_devices, 1)
    span = slice(stage.layer_start, stage.layer_end)
    saved = sum(layers.saved_bytes[span]) if layers.saved_bytes else 0
    inputs = layers.boundary_bytes[stage.layer_start] if layers.boundary_bytes else 0
    largest = max(layers.largest_bytes[span], default=0) if layers.largest_bytes else 0
    recomputed = sum(layers.recomputed_bytes[span]) * per_device if layers.recomputed_bytes else None
    working = max(layers.rerun_working_bytes[span], default=0) * per_device if layers.rerun_working_bytes else None
    acts = StageActivations(saved * per_device, inputs * per_device, dots * per_device, largest * per_device, recomputed,
                            working)
    return acts, held, position == len(stages) - 1


def kept_bytes(stage: StagePlan, layers: Layers, plan: Plan, dots: int = 0) -> float:
    """Per device, the activations the stage keeps under its recomputation policy."""
    acts, held, last = stage_activations(stage, layers, plan, dots)
    return float(activation_bytes(acts, held, stage.remat, fused=last))
