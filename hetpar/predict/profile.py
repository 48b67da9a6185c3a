"""Profiling: measure the devices this process sees and fit the predictor to them.

HETHUB's idea: profile a small cluster, predict the large one. A profile holds, per
device type, a `ComputeModel` fitted to measured matmul throughput over a range of
sizes, memory bandwidth and launch overhead, plus the latency and bandwidth of
all-reduce on the local mesh. It is plain JSON, so it can be taken on the cluster and
used offline. CPU virtual devices share the host's cores, so a profile records the
mesh size it was measured on: per-device figures are the mesh's share. How well a
mesh's devices share the cores is not proportional (one device's programs use every
core's threads; eight devices each run on their share and pay their kernels' fixed
costs over again), so a CPU profile may also be calibrated at other mesh sizes
(`DeviceProfile.meshes`), and a mesh is predicted from the calibration nearest its size.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetpar.errors import HetparError
from hetpar.predict.calibrate import LayerProgram, LayerSample, calibrated, layer_programs, layer_samples
from hetpar.predict.layer_profile import LayerRecord, merge_records
from hetpar.predict.timing import steady_time, steady_times
from hetpar.predict.compute import ComputeModel

if TYPE_CHECKING:
    from hetpar.cluster.groups import DeviceGroup

log = logging.getLogger("hetpar.profile")
# 2: measured layers (`Profile.layers`, predict/layer_profile.py); 3: their signatures free of
# program order, and the JAX they were traced under. Versions 1 and 3 read; 2 only without layers.
PROFILE_VERSION = 3


@dataclass
class DeviceProfile:
    device_type: str
    mesh_size: int
    compute: ComputeModel
    allreduce_latency_s: float
    allreduce_bandwidth: float  # bytes/s, ring bus bandwidth on the local mesh
    matmul_samples: list[tuple[float, float]] = field(default_factory=list)  # (FLOPs per device, seconds)
    shared_host: bool = False  # CPU virtual devices: one host's cores shared by the mesh
    layer_samples: list[LayerSample] = field(default_factory=list)  # the model's layers, timed (calibrate.py)
    layer_model: str = ""  # which model and batch the layers came from
    # Shared hosts: the same calibration taken on meshes of other sizes (size, model).
    meshes: list[tuple[int, ComputeModel]] = field(default_factory=list)

    def model_for(self, mesh_size: int) -> ComputeModel:
        """The compute model of one device of a mesh of `mesh_size` devices. Virtual CPU
        devices split one host: from the calibration taken on the mesh nearest in size
        (by ratio), a mesh k times larger gets 1/k of the throughput per device, and its
        per-kernel cost is paid k times over on the same cores. That proportion is
        only roughly true (how well XLA's threads share the cores changes with the
        mesh), so a calibrated size is used as measured and scaling bridges the rest."""
        if not self.shared_host:
            return self.compute
        calibrated = [(self.mesh_size, self.compute), *self.meshes]
        size, c = min(calibrated, key=lambda m: (abs(np.log(m[0] / mesh_size)), -m[0]))
        scale = size / mesh_size
        return replace(
            c,
            matmul_flops=c.matmul_flops * scale,
            vector_flops=c.vector_flops * scale,
            memory_bandwidth=c.memory_bandwidth * scale,
            op_overhead_s=c.op_overhead_s / scale,
        )


@dataclass
class Profile:
    devices: dict[str, DeviceProfile]
    version: int = PROFILE_VERSION
    layers: list[LayerRecord] = field(default_factory=list)  # each distinct layer of a step, timed (layer_profile.py)
    # The JAX the layers were traced under: another may trace a layer as other operators,
    # whose signature then matches no record (`pipeline.with_measured_layers` says so).
    jax_version: str = field(default_factory=lambda: jax.__version__)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(path: str | Path) -> "Profile":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise HetparError(f"cannot read profile {path}: {e}") from None
        if raw.get("version") not in (1, 2, PROFILE_VERSION):
            raise HetparError(f"profile {path} has version {raw.get('version')}; this hetpar reads versions 1 to {PROFILE_VERSION}")
        if raw.get("version") == 2 and raw.get("layers"):
            raise HetparError(f"profile {path} (version 2) keys its layer records by signatures in program order, which "
                              "this hetpar no longer computes (none would match): run hetpar profile --layers again")
        devices = {}
        for name, d in raw.get("devices", {}).items():
            d = dict(d)
            d["compute"] = ComputeModel(**d["compute"])
            d["matmul_samples"] = [tuple(s) for s in d["matmul_samples"]]
            d["layer_samples"] = [LayerSample(**s) for s in d.get("layer_samples", ())]
            d["meshes"] = [(int(size), ComputeModel(**c)) for size, c in d.get("meshes", ())]
            devices[name] = DeviceProfile(**d)
        return Profile(devices, layers=[LayerRecord.from_dict(r) for r in raw.get("layers", ())],
                       jax_version=raw.get("jax_version", ""))

    @staticmethod
    def merge(profiles: Sequence[tuple[str, "Profile"]]) -> "Profile":
        """Profiles made on several machines (name, profile) as one: one per device
        kind, made wherever that kind is. Two that measured the same kind are refused
        with both names."""
        devices: dict[str, DeviceProfile] = {}
        owner: dict[str, str] = {}
        for name, profile in profiles:
            for kind, entry in profile.devices.items():
                if kind in owner:
                    raise HetparError(f"both {owner[kind]} and {name} measured {kind}: merge one profile per device kind "
                                      "(leave one of the two out)")
                owner[kind], devices[kind] = name, entry
        versions = dict.fromkeys(p.jax_version for _, p in profiles if p.jax_version)
        return Profile(devices, layers=merge_records([(name, p.layers) for name, p in profiles]), jax_version=", ".join(versions))

    def compute_model(self, device_type: str) -> ComputeModel | None:
        entry = self.devices.get(device_type)
        return entry.compute if entry else None


def _steady_time(fn: Callable, *args: Any, repeats: int = 7) -> float:
    return steady_time(lambda: fn(*args), repeats)


def _mesh(devices: Sequence[Any]) -> Mesh:
    return Mesh(np.array(devices), ("data",), axis_types=(AxisType.Auto,))


def fit_affine(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares fit of seconds = t0 + flops / rate, weighted by 1/seconds so small
    and large sizes count alike. Returns (rate, t0)."""
    f = np.array([s[0] for s in samples])
    t = np.array([s[1] for s in samples])
    w = 1 / t
    A = np.stack([np.ones_like(f), f], axis=1) * w[:, None]
    (t0, inv_rate), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    t0 = max(float(t0), 0.0)
    inv_rate = max(float(inv_rate), 1e-18)
    return 1.0 / inv_rate, t0


# A timing is read as work only when it is well above a program's launch: on an H100 the
# matmuls up to 1024^3 (2 GFLOP) and a 16 MiB copy took 60-190 us, one to three launches
# of a near-empty program (54-82 us), and the fits read 20 or 470 TFLOP/s from one run to
# the next and bandwidths up to 3e16 B/s.
_ABOVE_LAUNCH = 20
_LARGEST_MATMUL = 16384
_LARGEST_COPY = 1 << 28  # elements per device: 1 GiB of float32


def measure(devices: Sequence[Any], device_type: str, sizes: Sequence[int] = (64, 128, 256, 512, 1024)) -> DeviceProfile:
    """Measures a mesh of `devices` (all of one type): matmuls of `sizes`, then of
    twice the size and more until one takes `_ABOVE_LAUNCH` launches, and a copy grown
    the same way (a fast accelerator finishes the small ones within the launch)."""
    mesh = _mesh(devices)
    n = len(devices)
    split = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())

    tiny = jax.device_put(jnp.ones((n, 8)), split)
    program_overhead = _steady_time(jax.jit(lambda x: x + 1, out_shardings=split), tiny)
    many = [jax.device_put(jnp.ones((n, 8)), split) for _ in range(32)]
    many_s = _steady_time(jax.jit(lambda *xs: [x + 1 for x in xs]), *many)
    argument_overhead = max(many_s - program_overhead, 0.0) / (2 * 31)  # 31 more inputs and outputs
    enough = _ABOVE_LAUNCH * program_overhead

    def matmul(size: int) -> tuple[float, float]:
        rows = size * n  # each device multiplies a (size x size) by (size x size)
        a = jax.device_put(jnp.ones((rows, size), jnp.float32), split)
        b = jax.device_put(jnp.ones((size, size), jnp.float32), replicated)
        seconds = _steady_time(jax.jit(lambda a, b: a @ b, out_shardings=split), a, b)
        log.info("matmul %d^3 on %d devices: %.3g s", size, n, seconds)
        return 2.0 * size**3, seconds

    def copy(elements: int) -> tuple[jax.Array, float]:
        big = jax.device_put(jnp.ones((n * elements,), jnp.float32), split)
        return big, _steady_time(jax.jit(lambda x: x * 2.0 + 1.0, out_shardings=split), big)

    samples, size = [matmul(s) for s in sizes], sizes[-1]
    while samples[-1][1] < enough and size < _LARGEST_MATMUL:
        size *= 2
        samples.append(matmul(size))
    # Matmul timings include the launch; the fitted t0 beyond it is per-operator cost.
    rate, t0 = fit_affine(samples)

    elements = 1 << 22  # 16 MiB per device
    big, copy_s = copy(elements)
    while copy_s < enough and elements < _LARGEST_COPY:
        elements *= 2
        big, copy_s = copy(elements)
    log.info("copy of %d MiB per device on %d devices: %.3g s", big.nbytes // n >> 20, n, copy_s)
    bandwidth = 2 * big.nbytes / n / max(copy_s - program_overhead, 1e-9)
    heavy_s = _steady_time(jax.jit(lambda x: ((x * 1.5 + 2.0) * x - 1.0) * x + 0.5, out_shardings=split), big)
    vector_flops = 7 * big.size / n / max(heavy_s - program_overhead, 1e-9)

    latency, bus_bandwidth = _allreduce_fit(mesh) if n > 1 else (0.0, float("inf"))
    compute = ComputeModel(
        device_type=device_type,
        matmul_flops=rate,
        half_flops=max(t0 - program_overhead, 0.0) * rate,
        vector_flops=vector_flops,
        memory_bandwidth=bandwidth,
        op_overhead_s=0.0,
        program_overhead_s=program_overhead,
        argument_overhead_s=argument_overhead,
        calibrated=True,
    )
    shared = devices[0].platform == "cpu"
    return DeviceProfile(device_type, n, compute, latency, bus_bandwidth, samples, shared)


def _allreduce_fit(mesh: Mesh) -> tuple[float, float]:
    """Fits all-reduce time = latency * 2(n-1) + 2(n-1)/n * bytes / bandwidth (ring)."""
    n = mesh.devices.size
    split = NamedSharding(mesh, PartitionSpec("data"))
    samples = []
    for elems in (1 << 8, 1 << 14, 1 << 18, 1 << 20):
        x = jax.device_put(jnp.ones((n, elems), jnp.float32), split)
        fn = jax.jit(lambda x: jnp.broadcast_to(x.sum(0, keepdims=True), x.shape), out_shardings=split)
        samples.append((elems * 4.0, _steady_time(fn, x)))
    rate, t0 = fit_affine([(2 * (n - 1) / n * b, t) for b, t in samples])
    return t0 / (2 * (n - 1)), rate


@dataclass(frozen=True)
class LayerWorkload:
    """A model whose layers calibrate the profile: its step, example arguments, and
    how many layers to cut it into."""

    name: str
    step: Callable
    args: tuple
    num_layers: int
    batch_argnum: int = 1


def profiled_groups(device_type: str | None = None, include_cpu: bool = False) -> list[tuple[str, "DeviceGroup"]]:
    """This process's device groups (`Cluster.local`), each with the name a profile
    files it under: `device_type`, the user's catalog name for the machine's devices,
    else the detected kind. On a machine with accelerators the host's CPU is profiled
    only with `include_cpu`, and keeps its own name: filed under the accelerators'
    name, its measurement (made after theirs) would replace theirs. `device_type`
    names one kind, so a machine with accelerators of two kinds is refused it."""
    from hetpar.cluster.cluster import Cluster

    groups = Cluster.local(include_cpu).groups
    named = [g for g in groups if g.type_name != "cpu"] or list(groups)  # the accelerators, or the CPU where alone
    if device_type and len(named) > 1:
        raise HetparError(f"a device type name (--device-type {device_type}) files one kind of device, and this machine "
                          f"has {len(named)}: {', '.join(g.type_name for g in named)}; leave it out to file each under "
                          "its detected name")
    return [(device_type if device_type and g in named else g.type_name, g) for g in groups]


def profile_local(
    mesh_size: int | None = None, device_type: str | None = None, layers: Sequence[LayerWorkload] = (),
    mesh_sizes: Sequence[int] = (), include_cpu: bool = False,
) -> Profile:
    """Profiles the devices of this process, grouped by kind (the host's CPU beside
    accelerators only with `include_cpu`, `profiled_groups`); with `layers`, also times
    those models' layers and fits the predictor's corrections to them. Two batch sizes
    of one model let the fit tell fixed costs from costs that grow with the work.
    `mesh_sizes`: on CPU virtual devices, meshes of these sizes are calibrated too
    (`DeviceProfile.meshes`); every mesh's layer programs are timed in one pool."""
    from hetpar.cluster.cluster import jax_devices

    profiles = {}
    for name, group in profiled_groups(device_type, include_cpu):
        main = mesh_size or len(group.device_ids)
        for size in mesh_sizes:
            if not 0 < size <= len(group.device_ids):
                raise HetparError(f"cannot calibrate a mesh of {size} devices: this process has "
                                  f"{len(group.device_ids)} {name} devices; pass mesh sizes up to that")
        entries = {main: measure(jax_devices(group.device_ids[:main]), name)}
        if entries[main].shared_host:
            for size in dict.fromkeys(mesh_sizes):
                entries.setdefault(size, measure(jax_devices(group.device_ids[:size]), name))
        elif mesh_sizes:
            log.info("%s: mesh sizes %s not calibrated: its devices do not share a host, so one size describes all",
                     name, list(mesh_sizes))
        if layers:
            calibrate_layers(entries, layers, {size: group.device_ids[:size] for size in entries})
        profiles[name] = with_meshes(entries[main], [e for size, e in entries.items() if size != main])
    return Profile(profiles)


def calibrate_layers(entries: dict[int, DeviceProfile], layers: Sequence[LayerWorkload],
                     device_ids: dict[int, Sequence[int]]) -> None:
    """Every entry's compute model corrected by `layers`' programs on its mesh, all of
    them timed in one interleaved pool."""
    programs = {size: calibration_programs(entry, layers, device_ids[size]) for size, entry in entries.items()}
    measured = iter(steady_times([p.run for size in entries for p in programs[size]]))
    for size, entry in entries.items():
        with_layers(entry, layers, layer_samples(programs[size], [next(measured) for _ in programs[size]]))


def with_meshes(entry: DeviceProfile, others: Sequence[DeviceProfile]) -> DeviceProfile:
    """`entry` holding the compute models of `others`, calibrations of meshes of other
    sizes of the same shared host (`DeviceProfile.model_for` picks among them)."""
    entry.meshes = sorted(((other.mesh_size, other.compute) for other in others), key=lambda m: m[0])
    return entry


def calibration_programs(entry: DeviceProfile, layers: Sequence[LayerWorkload], device_ids: Sequence[int]) -> list[LayerProgram]:
    """The layer programs of every workload on `device_ids`, to be timed together
    (interleaved: `timing.steady_times`) so that every sample sees the same moments."""
    return [p for w in layers for p in layer_programs(w.step, w.args, w.num_layers, device_ids, entry.compute, w.batch_argnum)]


def with_layers(entry: DeviceProfile, layers: Sequence[LayerWorkload], samples: Sequence[LayerSample]) -> DeviceProfile:
    """`entry` with its compute model corrected by the timed layer programs (calibrate.py)."""
    entry.compute = calibrated(entry.compute, samples)
    entry.layer_samples = list(samples)
    entry.layer_model = ", ".join(w.name for w in layers)
    return entry
