"""`hetpar profile --links`: this machine's links, measured, in the cluster file's terms.

A cluster file describes a node by datasheet figures (`intra_node` bandwidth and
latency, `host_bandwidth`, `peer_to_peer`), and measured clusters disagree with
datasheets most where it hurts: consumer cards without peer-to-peer copy through
host memory at a fraction of PCIe's rate. Here each figure is timed on the local
devices of one kind: a copy between two devices, and a copy to and from the host,
at a few sizes; a straight line through (bytes, seconds) gives a bandwidth (its
slope) and a latency (its intercept). A device-to-device copy no faster than going
through the host says the node has no peer-to-peer path.

Copies are timed on the wall clock, the least of several runs (other work only
ever slows a copy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from hetpar.predict.timing import steady_times

SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes per timed copy


@dataclass(frozen=True)
class LinkFit:
    bandwidth: float  # bytes/s
    latency: float  # s


@dataclass(frozen=True)
class MeasuredLinks:
    """One node's links as a cluster file's group states them."""

    device_kind: str
    devices: int
    intra_node: LinkFit  # device to device
    host: LinkFit  # device to host and back, each way
    peer_to_peer: bool

    def as_yaml(self) -> str:
        """The group fields, ready to paste under a group of a cluster file."""
        return "\n".join([
            f"# measured by hetpar profile --links on {self.devices} x {self.device_kind}",
            "intra_node:",
            f"  bandwidth: {self.intra_node.bandwidth:.4g}",
            f"  latency: {max(self.intra_node.latency, 1e-7):.3g}",
            f"peer_to_peer: {'true' if self.peer_to_peer else 'false'}",
            f"host_bandwidth: {self.host.bandwidth:.4g}",
        ])


def fit_line(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Bandwidth and latency of `seconds = latency + bytes / bandwidth`, by least
    squares; the latency is kept at zero or above, the bandwidth positive."""
    slope, intercept = np.polyfit(np.asarray(nbytes, float), np.asarray(seconds, float), 1)
    if slope <= 0:  # timing noise swamped the sizes: the largest copy's rate
        return LinkFit(max(nbytes) / max(seconds), 0.0)
    return LinkFit(1.0 / slope, max(0.0, float(intercept)))


def measure_links(devices: Sequence[Any], device_kind: str, sizes: Sequence[int] = SIZES,
                  repeats: int = 3) -> MeasuredLinks:
    """The links among `devices` (two or more of one kind): a copy from the first to
    the second, and from the first to the host and back."""
    if len(devices) < 2:
        raise ValueError(f"measuring a node's links needs two devices of a kind; this machine has {len(devices)} "
                         f"{device_kind}")
    src, dst = devices[0], devices[1]
    d2d, d2h, h2d = [], [], []
    for size in sizes:
        host = np.ones(size // 4, np.float32)
        on_src = jax.device_put(host, src)
        runs = [lambda: jax.device_put(on_src, dst),
                lambda: np.asarray(jax.device_get(on_src)),
                lambda: jax.device_put(host, src)]
        times = steady_times(runs, repeats=repeats, clocks=[time.perf_counter] * 3)
        for out, t in zip((d2d, d2h, h2d), times):
            out.append(t)
    intra = fit_line(sizes, d2d)
    to_host, from_host = fit_line(sizes, d2h), fit_line(sizes, h2d)
    host = LinkFit(min(to_host.bandwidth, from_host.bandwidth), max(to_host.latency, from_host.latency))
    # Through the host a byte crosses twice: peer-to-peer is a path faster than that.
    staged = 1.0 / (1.0 / to_host.bandwidth + 1.0 / from_host.bandwidth)
    # CPU devices are one host's memory: a copy between them is the peer-to-peer path.
    direct = src.platform == "cpu" or intra.bandwidth > 1.25 * staged
    return MeasuredLinks(device_kind, len(devices), intra, host, peer_to_peer=direct)
