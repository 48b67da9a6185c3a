"""What JAX leaves a plan of a device's memory.

On a GPU (CUDA or ROCm) the JAX client does not hand a process the whole device:
its allocator takes a fraction of the device's memory (XLA_PYTHON_CLIENT_MEM_FRACTION,
0.75 by default) and every array, temporary and library workspace XLA allocates
comes out of that pool. It takes the pool at start-up when it preallocates
(XLA_PYTHON_CLIENT_PREALLOCATE, true by default) and grows into it on demand when it
does not, but either way it will not go past it; only the `platform` allocator
(XLA_PYTHON_CLIENT_ALLOCATOR=platform, slow) allocates outside a pool. Out of that
share a process also keeps a per-process reserve (the device kind's
`process_reserve_bytes` in the catalog: runtime context, cuBLAS/cuDNN workspaces,
NCCL buffers; about 1 GiB on a GPU). So a plan may fill

    usable = memory_bytes * fraction - reserve

per device, and the planner and the estimator (`solver.cost`) count nothing more.
The fraction is read from the environment of the process that plans, which should
be the environment the plan runs in; a cluster file's group may set
`memory_fraction` and `process_reserve_gib` instead (for a plan made elsewhere).
CPU devices have no pool: the whole memory, no reserve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from hetpar.errors import ClusterError

ENV_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ENV_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
DEFAULT_FRACTION = 0.75  # JAX's default on GPU since jax 0.4.x (0.9 before)
POOLED_PLATFORMS = ("gpu", "rocm", "cuda")  # platforms whose JAX client allocates from a pool


@dataclass(frozen=True)
class ClientMemory:
    """The share of a device's memory the JAX client takes, and what set it."""

    fraction: float
    preallocate: bool
    setting: str  # in words, for messages: "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 (JAX's default)"


def client_memory(platform: str, environ: Mapping[str, str] | None = None) -> ClientMemory:
    """The JAX client's share of one device of `platform`, from `environ` (default: this
    process's environment)."""
    env = os.environ if environ is None else environ
    preallocate = env.get(ENV_PREALLOCATE, "true").strip().lower() not in ("false", "0", "no")
    if platform not in POOLED_PLATFORMS:
        return ClientMemory(1.0, False, f"no memory pool on {platform}")
    if env.get(ENV_ALLOCATOR, "").strip().lower() == "platform":
        return ClientMemory(1.0, False, f"{ENV_ALLOCATOR}=platform (no pool)")
    text = env.get(ENV_FRACTION)
    if text is None or not text.strip():
        return ClientMemory(DEFAULT_FRACTION, preallocate, f"{ENV_FRACTION}={DEFAULT_FRACTION:g} (JAX's default)")
    try:
        fraction = float(text)
    except ValueError:
        raise ClusterError(f"{ENV_FRACTION}={text!r} is not a number; set it to a fraction such as 0.9, or unset it") from None
    if not 0 < fraction <= 1:
        raise ClusterError(f"{ENV_FRACTION}={text} must be a fraction in (0, 1], e.g. 0.9; or unset it for JAX's default "
                           f"{DEFAULT_FRACTION:g}")
    return ClientMemory(fraction, preallocate, f"{ENV_FRACTION}={fraction:g}")
