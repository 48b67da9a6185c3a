"""Measured layer times, as the estimator reads them: plain numbers, no JAX.

`hetpar profile --layers` times each distinct layer of a traced step on real devices
(`hetpar.predict.layer_profile`); planning maps the records onto the layers of the
step being planned (by the layer's signature) and hands them to the estimator as
`MeasuredLayer`s. A layer with a measurement for a stage's device kind, tensor-parallel
degree and data-parallel degree is priced from it; every other layer from the
operator roofline (`StageCosts.per_layer`). Measured beats modelled: a roofline misses
what the device really does with a layer (unfused elementwise work, kernel choice,
precision), a measurement does not.

Between the microbatch sizes measured, times are interpolated linearly in the
examples each device runs; beyond them, extrapolated along the nearest two points
(one point: proportionally), since a layer's time is close to affine in its batch
(a fixed launch and latency part, and work that grows with the examples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerPoint:
    """One measured microbatch size of one layer. Seconds per microbatch on one device
    (per stage mesh on a shared host, `MeasuredLayer.shared_host`)."""

    examples: float  # per data-parallel device, per microbatch
    forward_s: float
    backward_s: float
    backward_remat_s: float = -1.0  # the backward rerunning the layer's forward; < 0: not measured
    once_s: float = 0.0  # per step: the layer's update (and, measured at dp > 1, its gradient reduction)
    send_s: float = 0.0  # the layer's input arriving from another mesh of as many devices (one way); 0: not measured
    stage_program_s: float = 0.0  # one more per-microbatch program's cost at this size; 0: the record's (`MeasuredLayer`)
    fused_s: float = 0.0  # forward and backward as one program, as a last stage runs them (with one program's cost); 0: not measured
    split_s: float = 0.0  # the runtime cutting the step's batch arguments into microbatches on the mesh, once; 0: not measured


@dataclass(frozen=True)
class MeasuredLayer:
    """Layer `layer` of the problem measured on devices of kind `kind` in a mesh of
    `dp` x `tp` devices. On a shared host (CPU virtual devices: one host's cores run
    every device) the times are the mesh's total, what the devices' work costs the
    host; elsewhere they are one device's."""

    kind: str
    layer: int
    tp: int
    dp: int
    points: tuple[LayerPoint, ...]
    shared_host: bool = False
    # What launching one program on the record's mesh costs, part of every measured time: a stage runs
    # its layers' forward (backward) as one program, so it pays this once, not once per layer.
    program_s: float = 0.0
    once_programs: int = 0  # the programs `once_s` spans (the layer's update, its preparation)
    # Once per step and per replica beyond the first: the runtime adding that replica's gradients of this
    # layer into the first's (each gradient array moved to the first's mesh and summed, one eager
    # program per array, `hetpar.runtime`'s replica combine); 0: not measured.
    merge_s: float = 0.0
    # What one more per-microbatch program costs on the record's mesh beyond its layers' work: the
    # first layers timed one program each against all of them as one stage that is not the last, its
    # forward and backward program (`hetpar.predict.layer_profile`); taken out of `forward_s`,
    # `backward_s` and `fused_s` and paid per stage program (a last stage runs one a microbatch). 0: not
    # measured, the near-empty program's `program_s` instead.
    stage_program_s: float = 0.0
    # The runtime's own host work per program it dispatches, beyond the program (the interpreter's
    # walk of the schedule: `hetpar.runtime.host_cost`); not part of any time above, so paid per
    # stage program on top of `stage_program_s`. 0: not measured.
    dispatch_s: float = 0.0

    def at(self, examples: float, field: str) -> float:
        """`field` of the points, interpolated to `examples` per device."""
        pts = sorted(self.points, key=lambda p: p.examples)
        xs = np.array([p.examples for p in pts], dtype=float)
        ys = np.array([getattr(p, field) for p in pts], dtype=float)
        return interpolate(xs, ys, float(examples))


def interpolate(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """Piecewise linear through (xs, ys), extended along the end segments; one point:
    proportional to x. Never below zero."""
    if len(xs) == 1:
        return max(0.0, float(ys[0]) * x / float(xs[0])) if xs[0] > 0 else float(ys[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, x)) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


@dataclass(frozen=True)
class LayerPrice:
    """What the estimator takes from a measurement for one layer on one stage config."""

    forward_s: float
    backward_s: float
    rerun_s: float | None  # what recomputation adds to the backward; None: not measured (the forward again)
    once_s: float
    includes_sync: bool  # measured on the stage's own data-parallel degree: its reduction is in the times
    program_s: float = 0.0  # one per-microbatch program's cost on the stage's mesh, taken out of the times above
    once_programs: int = 0
    once_launch_s: float = 0.0  # one once-per-step program's launch, taken out of `once_s`
    merge_s: float = 0.0  # combining one other replica's gradients of the layer into this one's (per step)
    send_s: float = 0.0  # the layer's input (one microbatch's) arriving from the stage before, one way; 0: not measured
    # The layer's forward and backward inside one program, as the pipeline's last stage runs them, less
    # the program's cost (`program_s`); None: not measured (the two nets above, as a stage that is not last).
    fused_s: float | None = None
    dispatch_s: float = 0.0  # the runtime's host work per program dispatched (`MeasuredLayer.dispatch_s`)
    split_s: float = 0.0  # the runtime cutting the batch into microbatches on the stage's mesh, once per step


def lookup(measured: tuple[MeasuredLayer, ...], kind: str, layer: int, tp: int, dp: int,
           examples: float) -> LayerPrice | None:
    """The price of `layer` on a `dp` x `tp` stage of `kind` at `examples` per device,
    or None where nothing was measured for that kind and tensor-parallel degree. The
    record of the same data-parallel degree is preferred; another one's times are one
    device's (and scaled by the devices on a shared host, whose work runs on the same
    cores one after another)."""
    mine = [m for m in measured if m.kind == kind and m.layer == layer and m.tp == tp]
    if not mine:
        return None
    record = min(mine, key=lambda m: (abs(np.log(m.dp / dp)), -m.dp))
    scale = dp / record.dp if record.shared_host else 1.0
    launch = record.program_s * scale
    sized = all(p.stage_program_s > 0 for p in record.points)  # measured at each microbatch size
    program = (record.at(examples, "stage_program_s") if sized else record.stage_program_s or record.program_s) * scale
    rerun = record.at(examples, "backward_remat_s") if all(p.backward_remat_s >= 0 for p in record.points) else None
    backward = record.at(examples, "backward_s") * scale
    once = float(np.mean([p.once_s for p in record.points])) * scale
    send = record.at(examples, "send_s") * scale if all(p.send_s > 0 for p in record.points) else 0.0
    fused = record.at(examples, "fused_s") * scale - program if all(p.fused_s > 0 for p in record.points) else None
    split = record.at(examples, "split_s") if all(p.split_s > 0 for p in record.points) else 0.0
    # Not floored at zero per layer: the per-program cost is what the layers apart cost beyond the
    # whole model as one program, and a small layer (an embedding: 0.3 ms on 4 CPU devices, against a
    # measured 1.5-3.7 ms per program) pays less than it alone. A stage is its layers' net times plus the
    # cost per program it runs (`StageCosts._times`, floored there), so a stage of all the layers is
    # priced as the whole model measured; floored per layer, the small layers' shortfall was added back,
    # ~11 ms a microbatch on a 4-device stage holding the embedding and the head.
    return LayerPrice(record.at(examples, "forward_s") * scale - program, backward - program,
                      None if rerun is None else max(0.0, rerun * scale - backward), max(0.0, once - record.once_programs * launch),
                      record.dp == dp, program, record.once_programs, launch, record.merge_s, send, fused,
                      record.dispatch_s, split)
