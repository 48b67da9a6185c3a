"""The device catalog: what each accelerator type can do on paper.

A device kind is one entry: in the packaged `devices.json`, or in a JSON file of the
same form that the HETPAR_DEVICES environment variable names (several separated by
the path separator), for a kind hetpar does not ship or a figure a site has
measured (an entry there replaces the packaged one of its name). The cluster
readers, the planner, the sharding ILP, the predictor and `Cluster.local()`'s
recognition of devices read every kind from here.

Rates are what the hardware has, per JAX device: a dtype a device has no units for
runs at its fp32 rate (bf16 on a V100), an f32 matmul gets TF32 where JAX's default
precision gives it (Ampere and later). `source` is a string or a mapping naming the
datasheet (`datasheet`, `url`) and where each figure comes from (`peak_flops`,
`memory`, `intra_node_link`, `process_reserve_bytes`). A cluster file may override
any figure for one group (`hetpar.cluster.groups.DeviceOverrides`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from hetpar.errors import ClusterError
from solver.collectives import SwitchReduction


@dataclass(frozen=True)
class Link:
    """A point-to-point link in the alpha-beta model: time = latency + bytes / bandwidth."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds
    overlaps: bool = True  # pipeline sends over it run beside compute (False: a blocking transport)
    reduction: SwitchReduction | None = None  # its switches sum in flight (a cluster file's in_network_reduction:)


@dataclass(frozen=True)
class DeviceType:
    name: str
    vendor: str
    platform: str  # one compiled program can only span devices of one platform
    peak_flops: dict[str, float]  # dtype -> FLOP/s, dense
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node_link: Link
    efficiency: float  # fraction of peak that large matmuls reach, until profiled
    source: str  # the datasheet
    # A matmul of this many FLOPs runs at half the sustained rate (`solver.efficiency`):
    # what makes small matmuls slow. About a 1k^3 matmul on a large GPU.
    matmul_half_flops: float = 2e9
    # What one process keeps of the device's memory besides its arrays (runtime
    # context, library workspaces): `hetpar.cluster.memory`.
    process_reserve_bytes: float = 0.0
    sources: tuple[tuple[str, str], ...] = ()  # figure -> where it comes from
    # The device's link to its host's memory (PCIe), one direction: what offloaded
    # optimizer state crosses. None: `hetpar.cluster.groups.HOST_LINK` (PCIe 4.0 x16).
    host_link: Link | None = None

    def flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s for a catalog dtype key (fp32, tf32, bf16, fp16, fp8); a dtype the
        device has no units for runs at its fp32 rate (XLA upcasts it)."""
        if dtype == "fp16" and "fp16" not in self.peak_flops:
            dtype = "bf16"
        return self.peak_flops.get(dtype, self.peak_flops["fp32"])

    def matmul_flops(self, dtype: str = "float32") -> float:
        """Peak for matmuls in `dtype` (a numpy dtype name). JAX's default precision
        runs float32 matmuls as TF32 on tensor-core GPUs from Ampere on, so float32 maps
        to tf32 (the fp32 rate on a device without TF32, such as a V100), unless
        `jax_default_matmul_precision` asks for more (`float32_matmul_key`)."""
        key = float32_matmul_key() if dtype == "float32" else DTYPE_KEYS.get(dtype, "fp8" if dtype.startswith("float8") else "fp32")
        if key == "fp8" and "fp8" not in self.peak_flops:
            key = "bf16"  # no fp8 units: XLA computes fp8 dots in a wider type
        return self.flops(key)

    def sustained_matmul_flops(self, dtype: str = "float32") -> float:
        """What large matmuls in `dtype` reach: the peak times `efficiency`. The rate
        `solver.efficiency`'s size curve approaches, for the planner and the sharding ILP."""
        return self.matmul_flops(dtype) * self.efficiency


def float32_matmul_key(precision: str | None = None) -> str:
    """The catalog rate a float32 matmul runs at under `precision` (default: this
    process's `jax_default_matmul_precision`, read when asked, so the plan is priced
    with the setting the step runs under): "tf32" under JAX's default (XLA picks TF32
    on Ampere and later; the catalog's tf32 is the fp32 rate on devices without it);
    "fp32" where full float32 is asked for ("highest", "float32"). "high" (bf16_3x or
    TF32, as the backend chooses) is priced as TF32."""
    if precision is None:
        try:
            import jax

            precision = jax.config.jax_default_matmul_precision
        except ImportError:  # no JAX here: JAX's default
            precision = None
    return "fp32" if str(precision).lower() in ("highest", "float32") else "tf32"


# numpy dtype name -> the catalog's key for its matmul rate.
DTYPE_KEYS = {"float32": "tf32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp32"}
# Keys a `peak_flops` entry may have.
FLOPS_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")

ENV_DEVICES = "HETPAR_DEVICES"
# What an entry must give (`matmul_half_flops` is optional); see devices.json's comment for units.
FIELDS = ("vendor", "platform", "peak_flops", "memory_bytes", "memory_bandwidth", "intra_node_link", "efficiency", "source")


def catalog() -> dict[str, DeviceType]:
    """Every device kind: the packaged entries, then those of the HETPAR_DEVICES files."""
    return _catalog(os.environ.get(ENV_DEVICES, ""))


@cache
def _catalog(extra: str) -> dict[str, DeviceType]:
    raw = json.loads(resources.files("hetpar.cluster").joinpath("devices.json").read_text())
    out = {name: _device(name, spec, "devices.json") for name, spec in raw.items() if not name.startswith("_")}
    for path in filter(None, extra.split(os.pathsep)):
        try:
            entries = json.loads(Path(path).read_text())
        except OSError as e:
            raise ClusterError(f"{ENV_DEVICES} names {path}, which cannot be read ({e.strerror}); fix or unset it") from None
        except json.JSONDecodeError as e:
            raise ClusterError(f"{path} (from {ENV_DEVICES}) is not JSON: {e}") from None
        if not isinstance(entries, dict):
            raise ClusterError(f"{path} (from {ENV_DEVICES}) must map device names to entries like devices.json's")
        out.update({name: _device(name, spec, path) for name, spec in entries.items() if not name.startswith("_")})
    return out


def _device(name: str, spec: dict, where: str) -> DeviceType:
    missing = [f for f in FIELDS if not isinstance(spec, dict) or f not in spec]
    if missing:
        raise ClusterError(f"{where}: device {name!r} lacks {', '.join(missing)}; an entry gives {', '.join(FIELDS)}")
    try:
        return _parsed(name, spec)
    except (KeyError, TypeError, ValueError) as e:
        raise ClusterError(f"{where}: device {name!r} has a malformed field ({type(e).__name__}: {e}); "
                           "see devices.json for the form of each") from None


def _parsed(name: str, spec: dict) -> DeviceType:
    link = spec["intra_node_link"]
    unknown = [k for k in spec["peak_flops"] if k not in FLOPS_KEYS]
    if unknown or "fp32" not in spec["peak_flops"]:
        raise ValueError(f"peak_flops needs fp32 and may give {', '.join(FLOPS_KEYS)}; got {', '.join(spec['peak_flops'])}")
    source = spec["source"]
    sources = tuple((str(k), str(v)) for k, v in source.items()) if isinstance(source, dict) else ()
    if isinstance(source, dict):
        source = " ".join(filter(None, (source.get("datasheet", ""), source.get("url", ""))))
    return DeviceType(
        name=name,
        vendor=spec["vendor"],
        platform=spec["platform"],
        peak_flops={k: float(v) for k, v in spec["peak_flops"].items()},
        memory_bytes=int(spec["memory_bytes"]),
        memory_bandwidth=float(spec["memory_bandwidth"]),
        intra_node_link=Link(link["name"], float(link["bandwidth"]), float(link["latency"])),
        efficiency=float(spec["efficiency"]),
        source=str(source),
        matmul_half_flops=float(spec.get("matmul_half_flops", 2e9 if spec["platform"] != "cpu" else 1e6)),
        process_reserve_bytes=float(spec.get("process_reserve_bytes", 0.0)),
        sources=sources,
        host_link=Link(spec["host_link"]["name"], float(spec["host_link"]["bandwidth"]), float(spec["host_link"]["latency"]))
        if "host_link" in spec else None,
    )


def device_type(name: str) -> DeviceType:
    known = catalog()
    if name not in known:
        raise ClusterError(f"unknown device type {name!r}; known types: {', '.join(sorted(known))}")
    return known[name]


def devices() -> list[DeviceType]:
    """Every device type hetpar knows, fastest fp32 first."""
    return sorted(catalog().values(), key=lambda d: -d.matmul_flops())
