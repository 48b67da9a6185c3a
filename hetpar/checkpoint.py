"""Checkpoints of the state a parallelized step returns, in one process or many.

orbax saves a sharded state in one process as it is. Across processes it cannot:
each of hetpar's stage meshes lies within a process, so to orbax every array is
"host local" (fully addressable on one process, absent on the others), which its
multi-host path refuses; and its barriers are device collectives, which CPU
processes without gloo do not have. So here the state is first brought to the host
(`to_host`: each array read where it lives and broadcast), process 0 writes it with
orbax alone, and every process restores it alone. orbax writes into a temporary
folder and renames it when complete, so a crash mid-save leaves the previous
checkpoint as it was. What comes back is host arrays: the next call of any plan, on
any cluster, places them (a restore needs no plan and no resharding of its own).
The cost is the whole state on every process's host while saving, which is what
checkpoints of the size this runtime serves (CPU tests, one machine's GPUs) afford.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hetpar.errors import HetparError
from hetpar.runtime.distributed import barrier, is_multiprocess, to_host
from hetpar.runtime.nvme_store import NvmeArray


def save_checkpoint(path: str | Path, state: Any, *, force: bool = False) -> None:
    """Saves `state` (as a step returned it, or any pytree of arrays) to `path`.
    Every process of a job must call it; it returns when the checkpoint is
    complete on disk. `force` replaces a checkpoint already at `path`. State on the
    NVMe tier (`NvmeArray` handles) is read from its files into the checkpoint."""
    path = Path(path).absolute()
    host = to_host(jax.tree.map(lambda x: x.read() if isinstance(x, NvmeArray) else jax.random.key_data(x) if _is_key(x) else x,
                                state))
    if jax.process_index() == 0:
        if path.exists() and not force:
            raise HetparError(f"a checkpoint already exists at {path}: pass force=True to replace it, or another path")
        checkpointer = _alone()
        checkpointer.save(path, host, force=force)
        checkpointer.wait_until_finished()
    if is_multiprocess():
        barrier()  # no process goes on (and perhaps fails) before the checkpoint is whole


def restore_checkpoint(path: str | Path, like: Any) -> Any:
    """The state saved at `path`, as host arrays in the structure of `like` (the
    state, or its `jax.eval_shape`), as host arrays: typed PRNG keys come back as keys. Pass it to any parallelized step, under any plan; it places
    it. Each process may call it on its own."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise HetparError(f"no checkpoint at {path}: save one with hetpar.save_checkpoint(path, state)")
    leaves, treedef = jax.tree.flatten(like)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    keys = [_is_key(x) for x in leaves]
    target = [jax.ShapeDtypeStruct(*_stored_shape(x), sharding=one_device) for x in leaves]
    try:
        saved = _alone().restore(path, jax.tree.unflatten(treedef, target))
    except (ValueError, KeyError, TypeError) as e:
        raise HetparError(f"the checkpoint at {path} does not match `like` ({str(e).strip()[:300]}): restore it with "
                          "the state structure it was saved from") from None
    # Host arrays (keys: uncommitted): in a job of several processes a committed array
    # is one global value, and each process's restored copy must be its own instead.
    got = [np.asarray(value) for value in jax.tree.leaves(saved)]
    out = [_as_key(value, want) if key else value for want, value, key in zip(leaves, got, keys)]
    return jax.tree.unflatten(treedef, out)


def _as_key(data: np.ndarray, like: Any) -> jax.Array:
    impl = jax.random.key_impl(like) if isinstance(like, jax.Array) else None  # abstract: the default kind
    return jax.random.wrap_key_data(data, impl=impl)


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _stored_shape(x: Any) -> tuple[tuple[int, ...], Any]:
    """What `to_host` saved for a leaf: typed PRNG keys as their key data."""
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        return data.shape, data.dtype
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    return tuple(x.shape), x.dtype


def latest_checkpoint(folder: str | Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step under `folder`, as `(step,
    path)`, from folders named `step_<n>` (save them so: `folder / f"step_{n}"`);
    None when there is none. A save cut short leaves only orbax's temporary folder,
    which is not counted."""
    best = None
    for child in Path(folder).glob("step_*"):
        number = child.name.removeprefix("step_")
        if child.is_dir() and number.isdigit() and (best is None or int(number) > best[0]):
            best = (int(number), child)
    return best


def _alone() -> ocp.StandardCheckpointer:
    """An orbax checkpointer that synchronises with no other process."""
    me = jax.process_index()
    return ocp.StandardCheckpointer(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))
