"""What a parallelized step hands back, and how to use it afterwards.

Policy (README, "After a step"):
* Parameters and optimizer state stay on the stage meshes that own them, sharded
  as their stage wants them, so the next step uses them in place with no copy.
  A function that is not itself parallelized (`jax.jit(eval_fn)(params, x)`,
  `optax.global_norm(params)`) cannot mix arrays that live on different meshes;
  `gather(state)` brings them to one device (or `jax.device_get(state)` to the
  host).
* Scalar float outputs (the loss, metrics) are all placed on one device, the
  one the first of them was computed on, so `loss + aux`, `float(loss)` and
  logging work directly. They are tiny, and the copy is asynchronous.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.runtime.communicator import DevicePath
from hetpar.runtime.nvme_store import NvmeArray


def _is_metric(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.floating)


def several_metrics(avals: Any) -> bool:
    """Whether outputs of these types hold two or more scalar floats: the only case in
    which `place_metrics` moves anything. Known from the trace, so a step that returns
    one loss skips the walk over its outputs on every call."""
    return sum(1 for a in avals if a.ndim == 0 and jnp.issubdtype(a.dtype, jnp.floating)) >= 2


def place_metrics(outputs: Any) -> Any:
    """The step's scalar float outputs, all on the device of the first of them."""
    scalars = [x for x in jax.tree.leaves(outputs) if _is_metric(x)]
    if len(scalars) < 2:
        return outputs
    home = jax.sharding.SingleDeviceSharding(next(iter(scalars[0].devices())))
    path = DevicePath()
    return jax.tree.map(lambda x: path.to_mesh(x, home) if _is_metric(x) else x, outputs)


def gather(tree: Any, device: jax.Device | None = None) -> Any:
    """Every array of `tree` on one device (default: `jax.devices()[0]`), whole, so
    that ordinary JAX code (`jax.jit(eval_fn)`, `optax.global_norm`) can use state a
    multi-stage step returned. Non-array leaves are returned as they are.

    When it is needed: after a step whose plan has more than one stage mesh (its
    summary says so), before passing the state to anything hetpar does not run; JAX
    refuses arrays on several meshes in one computation ("Received incompatible
    devices for jitted computation"). Not needed to call the step again, for a
    function parallelized `like=` the step (it runs where the state lies, and gather
    would only move it away), or to save a checkpoint with orbax. It copies every
    parameter onto one device, so that device must hold the whole state. State an
    `offload="nvme"` stage left on disk (`NvmeArray` handles) is read from its files."""
    target = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    path = DevicePath()

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return path.to_mesh(x, target)
        if isinstance(x, np.ndarray):
            return jax.device_put(x, target)
        if isinstance(x, NvmeArray):
            return jax.device_put(x.read(), target)
        return x

    return jax.tree.map(one, tree)


def like_options(options: Any, batch_argnum: int, static_argnums: Any, donate_argnums: Any) -> Any:
    """Options for an eval/predict function planned like a train step: the same
    cluster (the plan's own when the step ran from a plan file), microbatches,
    stages, schedule and meshes; the calling convention is the new function's."""
    from dataclasses import replace

    from hetpar.signature import normalize_argnums
    from hetpar.pipeline import cluster_for

    cluster = options.cluster if options.cluster is not None else cluster_for(options.plan)
    stage = options.stage
    stages = stage.num_stages or (options.plan.num_stages // options.plan.chunks if options.plan else None)
    if stages:
        stage = replace(stage, num_stages=stages, mode="manual" if stage.mode == "auto" else stage.mode)
    return replace(
        options, cluster=cluster, plan=None, batch_argnum=batch_argnum, stage=stage,
        static_argnums=normalize_argnums(static_argnums, "static_argnums"),
        donate_argnums=normalize_argnums(donate_argnums, "donate_argnums"),
    )
