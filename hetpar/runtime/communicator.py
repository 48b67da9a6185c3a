"""Moving values between stage meshes, one interface for both runtimes.

A device path: `device_put` copies shard by shard between devices (and not at all
when the value is already laid out as the destination wants), also between processes
under `jax.distributed`, where JAX pairs devices one to one: a value changing layout
on the way is re-laid on its own devices first, and one crossing between meshes of
different sizes goes through one device of each. A host path (`to_host`,
`from_host`) for the Ray runtime and kinds of device that cannot talk directly: the
value leaves as a host array (through Ray's object store there) and lands on the
destination mesh with its sharding.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from hetpar.compile.layouts import spec_sharding
from hetpar.errors import HetparError
from hetpar.runtime.remote import eager, has_local_devices, is_remote, placeholder


def already_there(x: Any, sharding: Any) -> bool:
    # Equality first: a tenth of the equivalence test's cost, and what a value a
    # program returned last step (laid out as the program wants it) passes.
    here = getattr(x, "sharding", None)
    return here is not None and (here == sharding or here.is_equivalent_to(sharding, x.ndim))


def _platform(devices: Any) -> str:
    return next(iter(devices)).platform


class DevicePath:
    """Device to device, within a process or across the processes of a
    `jax.distributed` job; through the host between kinds of device that share no
    link (a GPU stage and a CPU stage)."""

    def to_mesh(self, x: Any, sharding: Any) -> Any:
        if already_there(x, sharding):
            return x
        if isinstance(x, jax.Array) and _platform(x.devices()) != _platform(sharding.device_set):
            return _STAGED.to_mesh(x, sharding)  # no device link joins two platforms
        # A committed array that is not all here (or going elsewhere) is one global value
        # crossing processes; an uncommitted one is each process's own copy (the state
        # a script made before its first step), which `device_put` lays out as it is.
        if isinstance(x, jax.Array) and not (x.is_fully_addressable and sharding.is_fully_addressable):
            if _within_another_process(x, sharding):
                return placeholder(jax.ShapeDtypeStruct(x.shape, x.dtype), sharding)
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return self._keys(x, sharding)
            if x.committed:
                if len(x.sharding.device_set) != len(sharding.device_set):
                    return _through_one_device(x, sharding)
                x = _laid_out_at_source(x, sharding)
        return jax.device_put(x, sharding)

    def split_to(self, x: Any, pieces: tuple[tuple[int, int], ...], axis: int, target: Any) -> list | None:
        """`x`'s pieces ((start, size) along `axis`), each laid out as `target` wants
        it, device to device and in a few calls whatever the number of pieces (see
        `_Splitter`). None where this path does not apply (values on other
        processes, other kinds of device, shardings without a device order): the
        caller slices and moves each piece."""
        if not (isinstance(x, jax.Array) and isinstance(target, NamedSharding)
                and x.is_fully_addressable and target.is_fully_addressable):
            return None
        source = _device_order(x.sharding)
        if source is None or _platform(source) != _platform(target.device_set):
            return None
        if _small_on_cpu(x):
            return _split_through_host(x, pieces, axis, target)
        return _splitter(source, x.shape, pieces, axis, target)(x)

    def _keys(self, x: jax.Array, sharding: Any) -> jax.Array:
        """Typed PRNG keys (a dropout key) between processes: JAX moves only plain
        arrays across processes, so the keys travel as their key data and are wrapped
        again where they land (op by op: placeholders where a process holds none)."""
        impl = jax.random.key_impl(x)
        data = self.to_mesh(eager(jax.random.key_data, x), sharding)
        return eager(lambda d: jax.random.wrap_key_data(d, impl=impl), data)


# On CPU devices, whose memory is the host's, a small value (a step's batch of token
# ids) is cut as a host array: a read and one batched copy take a tenth of the time of
# the device path's multi-device programs (0.3 ms against 3 ms for a 32 x 64 batch
# moved from 8 devices to 4 in four pieces, measured here). The read waits for the
# value, which for a step's batch is there already. The rule reads only the platform
# and the size, never whether the value is ready yet, so a value takes the same path
# every step and the device path's programs are compiled on the first step or never
# (a step that compiles nothing after its first stays so). Accelerators and larger
# values keep the device path: there a trip through the host is a PCIe round trip and
# a sync.
HOST_SPLIT_MAX_BYTES = 1 << 20


def _small_on_cpu(x: jax.Array) -> bool:
    return (_platform(x.devices()) == "cpu" and x.nbytes <= HOST_SPLIT_MAX_BYTES
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended))


def _split_through_host(x: jax.Array, pieces: tuple[tuple[int, int], ...], axis: int, target: Any) -> list:
    whole = np.asarray(x)
    cut = [whole[(slice(None),) * axis + (slice(start, start + size),)] for start, size in pieces]
    return jax.device_put(cut, [target] * len(cut))


def _within_another_process(x: jax.Array, sharding: Any) -> bool:
    """Whether `x` and its destination lie within one process that is not this one
    (two stages of one process's group): a local copy there, in which no other
    process takes part. JAX's cross-process copy, which needs every process, pairs
    only different processes' devices and refuses this move."""
    processes = {d.process_index for d in x.sharding.device_set} | {d.process_index for d in sharding.device_set}
    return len(processes) == 1 and jax.process_index() not in processes


def _through_one_device(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` moved between processes whose meshes have different numbers of devices (a
    node of 8 A100s feeding a node of 4 V100s), which JAX's cross-process copy does not
    do (it pairs devices one to one): made whole on its mesh, sent from one device of
    it to one device of the destination, and cut into the destination's shards there.
    Each hop runs on the devices of the processes that hold them (the others make
    placeholders), device to device: no hop passes through the host. Both meshes lie
    within one process each (`check_cross_process`)."""
    struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
    first = lambda devices: min(devices, key=lambda d: d.id)  # noqa: E731  (the same on every process)
    start, end = first(x.sharding.device_set), first(sharding.device_set)
    if is_remote(x):
        sent = placeholder(struct, SingleDeviceSharding(start))
    else:
        whole = x if x.sharding.is_fully_replicated else _relayout(_replicated(x.sharding))(x)
        sent = next(s.data for s in whole.addressable_shards if s.device == start)
    landed = jax.device_put(sent, SingleDeviceSharding(end))
    if not has_local_devices(sharding.device_set):
        return placeholder(struct, sharding)
    pieces = [jax.device_put(landed[index], device) for device, index in sharding.addressable_devices_indices_map(x.shape).items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)


def _device_order(sharding: Any) -> tuple | None:
    """The devices of `sharding` in the order a program over them lists them."""
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.mesh.devices.flat)
    if isinstance(sharding, SingleDeviceSharding):
        return tuple(sharding.device_set)
    return None


class _Splitter:
    """How `DevicePath.split_to` cuts a value on `source` (devices, in program
    order) into pieces for `target`, by kind of move:

    - the target's devices, in the same order: one program cuts the pieces;
    - as many other devices: one program cuts them laid out as the target's shards
      are (the target's mesh over the source's devices), and one batched copy,
      shard for shard, lands them;
    - otherwise (a batch laid out over 8 devices for a stage of 4): the whole value
      is laid out on the source so that each of the target's shards is held whole
      by some source device (each held twice on twice as many devices; everything
      on every device where the counts do not divide), copied over once, and cut
      there by one program.

    JAX's own copy between meshes of different sizes would go through the host
    (waiting for the value) wherever no source shard is exactly a target shard,
    the case of a microbatch cut from a batch spread over more devices; and copies
    that must pick shards out one by one cost host time per shard, so the value
    crosses once, whole, not once per piece."""

    def __init__(self, source: tuple, shape: tuple[int, ...], pieces: tuple[tuple[int, int], ...], axis: int,
                 target: NamedSharding):
        def cut(out: Any) -> Any:
            return jax.jit(lambda a: tuple(jax.lax.slice_in_dim(a, s, s + n, axis=axis) for s, n in pieces),
                           out_shardings=(out,) * len(pieces))

        ns, nd = len(source), target.mesh.devices.size
        grid, names = target.mesh.devices.shape, target.mesh.axis_names
        self.relayout = self.landing = None
        if source == tuple(target.mesh.devices.flat):
            self.cut = cut(target)
        elif ns == nd:
            self.cut, self.landing = cut(NamedSharding(_mesh(np.array(source).reshape(grid), names), target.spec)), target
        else:
            if ns % nd == 0:  # each target shard held by ns / nd source devices
                whole = spec_sharding(target.mesh, jax.ShapeDtypeStruct(shape, np.float32), tuple(target.spec))
                twin = _mesh(np.array(source).reshape(*grid, ns // nd), (*names, "_copies"))
                self.relayout, self.landing = _relayout(NamedSharding(twin, whole.spec)), whole
            else:
                self.relayout = _relayout(NamedSharding(_mesh(np.array(source), ("_all",)), PartitionSpec()))
                self.landing = NamedSharding(target.mesh, PartitionSpec())
            self.cut = cut(target)

    def __call__(self, x: jax.Array) -> list:
        if self.relayout is not None:  # moved whole, then cut where it lands
            return list(self.cut(jax.device_put(self.relayout(x), self.landing)))
        out = self.cut(x)
        return list(out if self.landing is None else jax.device_put(list(out), [self.landing] * len(out)))


_splitter = lru_cache(maxsize=256)(_Splitter)


def _mesh(devices: np.ndarray, names: tuple) -> Mesh:
    return Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _replicated(sharding: Any) -> NamedSharding:
    """The whole value on every device of `sharding`."""
    return NamedSharding(Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id)), ("all",)), PartitionSpec())


def _laid_out_at_source(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` laid out as `sharding` wants, still on its own devices. Between the device
    sets of different processes JAX moves an array only shard for shard (both sides
    cut alike: the same layout over meshes of one shape), so a value whose layout
    changes on the way (a gradient laid out over `data` on one stage that the other
    keeps replicated) is first re-laid where it is: a reshard among its own devices,
    run by the processes that hold it (the others make a placeholder of the result).
    Meshes of different sizes take `_through_one_device` instead."""
    source = x.sharding
    if not (isinstance(source, NamedSharding) and isinstance(sharding, NamedSharding)):
        return x
    if source.device_set == sharding.device_set or source.mesh.devices.size != sharding.mesh.devices.size:
        return x
    mesh = Mesh(source.mesh.devices.reshape(sharding.mesh.devices.shape), sharding.mesh.axis_names)
    staged = NamedSharding(mesh, sharding.spec)
    if source.is_equivalent_to(staged, x.ndim):
        return x
    if is_remote(x):
        return placeholder(jax.ShapeDtypeStruct(x.shape, x.dtype), staged)
    return _relayout(staged)(x)


@lru_cache(maxsize=256)
def _relayout(sharding: Any) -> Any:
    """A program that lays its input out as `sharding` among the same devices (a
    collective on device, never a trip through the host), compiled once per layout."""
    return jax.jit(lambda a: a, out_shardings=sharding)


class HostStagedPath:
    """Between devices no link joins (two vendors' accelerators): the value goes
    device -> host -> device, in chunks of at most `chunk_bytes` along its first
    axis, so that one chunk's copy to the destination runs while the next is still
    on its way to the host. Within one process; a value between two processes of
    different vendors would need a host channel between the processes, which this
    runtime does not have (`check_host_staged` refuses such plans before a step)."""

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = chunk_bytes

    def to_mesh(self, x: Any, sharding: Any) -> Any:
        if already_there(x, sharding):
            return x
        if not isinstance(x, jax.Array):
            return jax.device_put(x, sharding)
        if is_remote(x) and not has_local_devices(sharding.device_set):
            return placeholder(jax.ShapeDtypeStruct(x.shape, x.dtype), sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(self.to_mesh(jax.random.key_data(x), sharding), impl=impl)
        rows = x.shape[0] if x.ndim else 1
        per_row = max(1, x.nbytes // max(rows, 1))
        step = max(1, self.chunk_bytes // per_row)
        if x.ndim == 0 or step >= rows:
            return jax.device_put(np.asarray(jax.device_get(x)), sharding)
        chunks = [x[start:start + step] for start in range(0, rows, step)]
        for chunk in chunks:  # every chunk starts for the host at once ...
            chunk.copy_to_host_async()
        # ... and each goes on to one destination device as soon as it is there
        # (device_put returns before its copy ends), where they are joined and then
        # laid out as the destination wants, device to device.
        first = min(sharding.device_set, key=lambda d: d.id)
        landed = [jax.device_put(np.asarray(chunk), first) for chunk in chunks]
        return jax.device_put(jax.numpy.concatenate(landed, axis=0), sharding)


_STAGED = HostStagedPath()


def check_host_staged(vendors: dict[int, str], devices: Any) -> None:
    """Refuses a plan whose values would cross between two vendors' devices that lie
    on different processes (see HostStagedPath)."""
    by_process: dict[int, set[str]] = {}
    for d in devices:
        if d.id in vendors:
            by_process.setdefault(d.process_index, set()).add(vendors[d.id])
    if len(by_process) > 1 and len(set().union(*by_process.values())) > 1:
        raise HetparError(
            "this plan moves values between two vendors' devices on different processes "
            f"({', '.join(f'process {p}: {"/".join(sorted(v))}' for p, v in sorted(by_process.items()))}); "
            "hetpar stages such values through host memory only within one process so far: "
            "run the two vendors' stages in one process, or plan each vendor's devices as its own job")


class HostKeys:
    """Typed PRNG keys on their way through the host: their key data and implementation
    (numpy has no key type)."""

    def __init__(self, data: np.ndarray, impl: str):
        self.data, self.impl = data, impl


def to_host(x: Any) -> Any:
    """The host path out: `x` as a value that pickles (a numpy array, or HostKeys)."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return HostKeys(np.asarray(jax.device_get(jax.random.key_data(x))), str(jax.random.key_impl(x)))
    return np.asarray(jax.device_get(x))


def from_host(x: Any, sharding: Any = None) -> Any:
    """The host path in: a `to_host` value as a jax Array laid out as `sharding`
    (on the default device without one)."""
    if isinstance(x, HostKeys):
        keys = jax.random.wrap_key_data(x.data, impl=x.impl)
        return keys if sharding is None else jax.device_put(keys, sharding)
    return jax.numpy.asarray(x) if sharding is None else jax.device_put(x, sharding)
