"""Where a stage's optimizer state may live off its devices (host memory, a node's
local disk: `solver.memory.OFFLOAD_TIERS`), how much room each tier has, and what
moving the state costs every step. The stage tables price an offloaded choice with
these; the search and the mixed stages ask whether a kind may offload at all."""

from __future__ import annotations

import numpy as np

from solver.cost.problem import DeviceKind, Problem
from solver.cost.stage_config import StageConfig


class OffloadPrices:
    def __init__(self, problem: Problem, kinds: dict[str, DeviceKind]):
        self.problem = problem
        self.kinds = kinds

    def allowed(self, kind: DeviceKind) -> bool:
        """Whether a stage of `kind` may keep its optimizer state off its devices: the
        problem allows a tier whose room on the node is known (host memory, a local
        disk), and there is state to keep."""
        if not self.problem.training:
            return False
        if kind.host_memory_bytes <= 0:  # the disk tier stages through host memory too
            return False
        return "host" in self.problem.offload_tiers or "nvme" in self.problem.offload_tiers and kind.nvme_bytes > 0

    def tiers(self, cfg: StageConfig) -> list[str]:
        """Where the stage's optimizer state may live (solver.memory.OFFLOAD_TIERS)."""
        tiers = [t for t in self.problem.offload_tiers if t == "" or self.problem.training]
        return tiers or [""]

    def host_capacity(self, kind: str) -> float:
        """Host memory a device of `kind` may fill with offloaded state (its share of its
        node's); 0 where unknown."""
        return float(self.kinds[kind].host_memory_bytes)

    def nvme_capacity(self, kind: str) -> float:
        """Disk bytes a device of `kind` may fill with NVMe-tier state (its share of its
        node's local disk); 0 where none is declared."""
        return float(self.kinds[kind].nvme_bytes)

    def nvme_transfer_s(self, cfg: StageConfig, nbytes: np.ndarray | float) -> np.ndarray | float:
        """Seconds to read `nbytes` of NVMe-tier state per device from the node's disk
        and write the updated state back, every step: a disk reads and writes over one
        bandwidth (not full duplex), shared by the node's devices that use it. On top
        of the host link's time (`host_transfer_s`): the state crosses both."""
        kind = self.kinds[cfg.kind]
        if kind.nvme_bandwidth <= 0:
            return np.asarray(nbytes, dtype=float) * np.inf
        share = kind.nvme_bandwidth / min(cfg.devices, kind.devices_per_node)
        return 2 * np.asarray(nbytes, dtype=float) / share

    def host_transfer_s(self, cfg: StageConfig, nbytes: np.ndarray | float) -> np.ndarray | float:
        """Seconds to stream `nbytes` of offloaded state per device to the device and the
        updated state back, every step: each byte crosses the host link once each way,
        the two directions at once (PCIe is full duplex), the node's devices sharing
        its host memory. Not hidden under the update's compute: the update waits for
        its state."""
        kind = self.kinds[cfg.kind]
        link = kind.host_link.per_flow(min(cfg.devices, kind.devices_per_node))
        return link.latency + np.asarray(nbytes, dtype=float) / link.bandwidth
