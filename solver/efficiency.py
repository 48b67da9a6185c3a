"""How fast a matmul runs for its size: one curve for the planner and the predictor.

A matmul of F FLOPs reaches `sustained * F / (F + F_half)` FLOP/s: small matmuls run
far below peak (kernel launch, tile quantization and pipeline fill dominate), large
ones approach the device's sustained rate. `sustained` (a fraction of the datasheet
peak) and `F_half` (the size reaching half of it) are per device kind, from the
device catalog or a profile; nothing else about the device enters.
"""

from __future__ import annotations

import numpy as np


def matmul_rate(sustained_flops: float, flops_each, half_flops: float):  # noqa: ANN001, ANN201 (float or array in, same out)
    """FLOP/s of a matmul of `flops_each` FLOPs (a number or an array of them); the
    flat `sustained_flops` where the size or the curve is unknown (0)."""
    each = np.asarray(flops_each, dtype=float)
    if half_flops <= 0:
        out = np.full_like(each, sustained_flops)
    else:
        out = np.where(each > 0, sustained_flops * each / (each + half_flops + (each <= 0)), sustained_flops)
    return float(out) if out.ndim == 0 else out


def matmul_time(flops: float, flops_each: float, sustained_flops: float, half_flops: float) -> float:
    """Seconds for `flops` FLOPs of matmuls of `flops_each` FLOPs each."""
    if flops <= 0:
        return 0.0
    return flops / matmul_rate(sustained_flops, flops_each, half_flops)
