"""The device catalog: what each accelerator type can do on paper."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from hetpar.errors import ClusterError


@dataclass(frozen=True)
class Link:
    """A point-to-point link in the alpha-beta model: time = latency + bytes / bandwidth."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds


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
    source: str
    # A matmul of this many FLOPs runs at half the sustained rate (`solver.efficiency`):
    # what makes small matmuls slow. About a 1k^3 matmul on a large GPU.
    matmul_half_flops: float = 2e9

    def flops(self, dtype: str = "fp32") -> float:
        return self.peak_flops.get(dtype, self.peak_flops["fp32"])

    def matmul_flops(self, dtype: str = "float32") -> float:
        """Peak for matmuls in `dtype` (a numpy dtype name). JAX's default precision
        runs float32 matmuls as TF32 on tensor-core GPUs, so float32 maps to tf32."""
        key = {"float32": "tf32", "bfloat16": "bf16", "float16": "bf16"}.get(dtype, "fp32")
        return self.flops(key)


@cache
def catalog() -> dict[str, DeviceType]:
    raw = json.loads(resources.files("hetpar.cluster").joinpath("devices.json").read_text())
    return {name: _device(name, spec) for name, spec in raw.items() if not name.startswith("_")}


def _device(name: str, spec: dict) -> DeviceType:
    link = spec["intra_node_link"]
    return DeviceType(
        name=name,
        vendor=spec["vendor"],
        platform=spec["platform"],
        peak_flops={k: float(v) for k, v in spec["peak_flops"].items()},
        memory_bytes=int(spec["memory_bytes"]),
        memory_bandwidth=float(spec["memory_bandwidth"]),
        intra_node_link=Link(link["name"], float(link["bandwidth"]), float(link["latency"])),
        efficiency=float(spec["efficiency"]),
        source=spec["source"],
        matmul_half_flops=float(spec.get("matmul_half_flops", 2e9 if spec["platform"] != "cpu" else 1e6)),
    )


def device_type(name: str) -> DeviceType:
    known = catalog()
    if name not in known:
        raise ClusterError(f"unknown device type {name!r}; known types: {', '.join(sorted(known))}")
    return known[name]


def devices() -> list[DeviceType]:
    """Every device type hetpar knows, fastest fp32 first."""
    return sorted(catalog().values(), key=lambda d: -d.matmul_flops())
