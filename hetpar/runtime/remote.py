"""Values and programs that live on other processes' devices.

Under `jax.distributed`, a process that calls a jitted program whose mesh has none
of its devices gets back arrays with no local shards. It needs those arrays (their
shape, dtype and sharding) to take part in moving them across processes, but not
the program run: on CPU without cross-process collectives (each process's stages
use XLA's in-process collectives, hetpar/runtime/distributed.py), JAX even refuses
to compile it. So a process makes the same arrays itself, as placeholders with no
local shards, from the program's output types, and never dispatches the program.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def is_remote(x: Any) -> bool:
    """An array none of whose shards lie on this process's devices."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.addressable_shards


def has_local_devices(devices: Any) -> bool:
    here = jax.process_index()
    return any(d.process_index == here for d in devices)


def placeholder(struct: jax.ShapeDtypeStruct, sharding: Any = None) -> jax.Array:
    """An array of `struct`'s type on devices of other processes, holding no data here."""
    return jax.make_array_from_single_device_arrays(struct.shape, sharding or struct.sharding, [], dtype=struct.dtype)


def skipped(fn: Callable) -> Callable:
    """`fn` (jitted, with its output shardings fixed) as this process sees it when
    none of its devices take part: placeholders of its outputs, no dispatch. Output
    types are cached per argument shapes (eval_shape traces, it does not compile)."""
    types: dict[tuple, Any] = {}

    def call(*args: Any) -> Any:
        key = tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in jax.tree.leaves(args))
        out = types.get(key)
        if out is None:
            out = types[key] = fn.eval_shape(*args)
        return jax.tree.map(placeholder, out)

    call.lower = getattr(fn, "lower", None)  # Program.lower still reaches the jitted function
    return call


def eager(op: Callable, *args: Any) -> Any:
    """`op(*args)` (an op-by-op JAX call), or where its operands lie on other
    processes' devices, a placeholder of its result on the first operand's sharding
    (those processes compute it; this one only needs its type)."""
    first = next((x for x in args if is_remote(x)), None)
    if first is None:
        return op(*args)
    return placeholder(jax.eval_shape(op, *args), first.sharding)
