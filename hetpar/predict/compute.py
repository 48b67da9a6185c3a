"""Compute time of operators and programs: a roofline with size-dependent efficiency.

time(op) = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth), plus a fixed
overhead per kernel the program runs (see predict/programs.py for what counts as one).
Achievable FLOP/s for a matmul of F FLOPs is peak * F / (F + F_half): small matmuls
run far below peak (launch, tiling, and pipeline fill dominate), large ones approach
the device's sustained peak. Elementwise work is fused by XLA, so it is charged for
the bytes it writes, not for every read of an intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cluster.catalog import DeviceType
from hetpar.trace.flops import MATMUL_OPS
from solver.efficiency import matmul_rate


@dataclass(frozen=True)
class ComputeModel:
    device_type: str
    matmul_flops: float  # sustained FLOP/s of large matmuls
    half_flops: float  # a matmul of this many FLOPs runs at half of matmul_flops
    vector_flops: float  # FLOP/s of fused elementwise work
    memory_bandwidth: float  # sustained bytes/s
    op_overhead_s: float  # fixed cost per kernel: a matmul, a reduction, or a fusion
    program_overhead_s: float  # fixed cost per program launch (dispatch)
    argument_overhead_s: float = 0.0  # launch cost per argument buffer
    calibrated: bool = False  # from a profile of real devices, not the catalog
    # Corrections fitted to measured layer programs (see predict/calibrate.py): what the
    # micro-benchmarks miss about real programs (fusion quality, cache reuse, dispatch).
    matmul_scale: float = 1.0
    vector_scale: float = 1.0
    launch_scale: float = 1.0
    # Transposes are strided copies: on CPU they run several times below the streaming
    # bandwidth the roofline charges them, so they get a correction of their own.
    transpose_scale: float = 1.0

    @staticmethod
    def from_catalog(spec: DeviceType, dtype: str = "float32") -> "ComputeModel":
        peak = spec.matmul_flops(dtype) * spec.efficiency
        gpu_like = spec.platform != "cpu"
        return ComputeModel(
            device_type=spec.name,
            matmul_flops=peak,
            half_flops=spec.matmul_half_flops,
            vector_flops=spec.flops("fp32") * spec.efficiency,
            memory_bandwidth=spec.memory_bandwidth * 0.8,
            op_overhead_s=5e-6 if gpu_like else 1e-6,
            program_overhead_s=20e-6 if gpu_like else 50e-6,
        )

    def op_time(self, name: str, flops: float, bytes_in: float, bytes_out: float) -> float:
        """`bytes_in`/`bytes_out` are what really crosses memory: for an operator fused
        into its neighbours, only the buffers the fusion reads or writes."""
        if name in MATMUL_OPS:
            return self.matmul_scale * self.raw_op_time(name, flops, bytes_in, bytes_out)
        if name == "transpose":
            return self.transpose_scale * self.raw_op_time(name, flops, bytes_in, bytes_out)
        return self.vector_scale * self.raw_op_time(name, flops, bytes_in, bytes_out)

    def raw_op_time(self, name: str, flops: float, bytes_in: float, bytes_out: float) -> float:
        """The roofline alone, before the fitted corrections."""
        if name in MATMUL_OPS:
            if flops <= 0:
                return 0.0
            rate = matmul_rate(self.matmul_flops, flops, self.half_flops)
            return max(flops / rate, (bytes_in + bytes_out) / self.memory_bandwidth)
        return max(flops / self.vector_flops, (bytes_in + bytes_out) / self.memory_bandwidth)

    def launch_time(self, num_arguments: int) -> float:
        return self.launch_scale * self.raw_launch_time(num_arguments)

    def raw_launch_time(self, num_arguments: int) -> float:
        return self.program_overhead_s + num_arguments * self.argument_overhead_s
