"""Calibration on a model's own layers.

Micro-benchmarks (a matmul, a copy) miss what real programs do: how well XLA fuses
a layer's elementwise tails, how much a layer reuses cache, what dispatch costs with
many arguments. So `hetpar profile --model ...` also runs the model's layers one by
one (each layer's forward, backward and update as its own program, on the profiled
mesh) and fits one correction per kind of work (launch, matmul, vector, transposes)
and a fixed cost per kernel to their measured times. Transposes are their own kind:
XLA:CPU runs them as strided copies, about five times slower per byte than the
fused elementwise work they were priced with (the Adam update's program, which
transposes gradients back to their weights' layout, came out 20-30% under). The
fit is a non-negative least squares on relative error: every layer counts alike,
large or small. Stage programs and whole steps of any plan are
then predicted from the corrected model; they are never measured here.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from hetpar.compile.programs import Program, shared_zeros, stage_mesh
from hetpar.compile.step import compile_layer_stages
from hetpar.predict.compute import ComputeModel
from hetpar.predict.programs import TimeTerms, time_terms
from hetpar.predict.timing import steady_time
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import build_layers
from hetpar.trace.traced_step import trace_step

log = logging.getLogger("hetpar.profile")


@dataclass(frozen=True)
class LayerSample:
    program: str  # e.g. "fwd@stage2": the forward of layer 2
    measured_s: float
    launch_s: float  # the uncorrected prediction, by kind of work
    matmul_s: float
    vector_s: float
    kernels: int = 0
    transpose_s: float = 0.0


def program_inputs(program: Program, graph: Any, zeros: dict | None = None) -> list[Any]:
    """Zero-filled arguments with the program's shapes and shardings, one array per
    shape, dtype and sharding, in `zeros` where the caller keeps that dict for a set of
    runs: a program donates only its accumulators, never these, so runs may share
    them, and a profile of a large model's many programs holds each weight's zeros
    once rather than once per program (a Llama of 669 MiB of state: 2,695 MiB of
    arrays alive before its host-cost run, 1,599 MiB with them shared)."""
    made = {} if zeros is None else zeros
    return [shared_zeros(made, graph.avals[v].shape, graph.avals[v].dtype, sharding)
            for v, sharding in zip(program.task.inputs, program.in_shardings)]


def program_run(program: Program, graph: Any, zeros: dict | None = None) -> Callable[[], Any]:
    """One run of `program` on zero-filled arguments (shared through `zeros`, as
    `program_inputs` says), accumulators included: what `timing.steady_time(s)` times."""
    inputs = program_inputs(program, graph, zeros)
    return lambda: program.fn(program.init_acc() if program.init_acc else (), *inputs)


def time_program(program: Program, graph: Any, repeats: int = 7) -> float:
    """Seconds of one run, accumulators included (`timing.steady_time`)."""
    return steady_time(program_run(program, graph), repeats)


@dataclass(frozen=True)
class LayerProgram:
    """One layer program of a calibration workload, ready to time: its run and its
    uncorrected predicted time by kind of work."""

    name: str
    run: Callable[[], Any]
    terms: TimeTerms


def layer_programs(
    fn: Callable,
    args: tuple,
    num_layers: int,
    device_ids: Sequence[int],
    model: ComputeModel,
    batch_argnum: int = 1,
) -> list[LayerProgram]:
    """Each layer's programs, compiled alone on one mesh of `device_ids`."""
    traced = trace_step(fn, args, batch_argnum, 1)
    layers = build_layers(traced.full, traced.analysis, [c.flops for c in op_costs(traced.full)], num_layers)
    mesh = stage_mesh(tuple(device_ids))
    compiled = compile_layer_stages(traced, layers, list(range(layers.num_layers)), {i: mesh for i in range(layers.num_layers)})
    return [
        LayerProgram(program.task.name, program_run(program, compiled.graph),
                     time_terms(program.task, compiled.graph, compiled.analysis, len(device_ids), model))
        for program in compiled.programs
    ]


def layer_samples(programs: Sequence[LayerProgram], measured: Sequence[float]) -> list[LayerSample]:
    """The fit's samples: each program's measured seconds beside its terms."""
    samples = []
    for program, seconds in zip(programs, measured):
        t = program.terms
        samples.append(LayerSample(program.name, seconds, t.launch_s, t.matmul_s, t.vector_s, t.kernels, t.transpose_s))
        log.info("layer program %s: %.3g s (uncorrected prediction %.3g s)", program.name, seconds,
                 t.launch_s + t.matmul_s + t.vector_s + t.transpose_s)
    return samples


def fit_scales(samples: Sequence[LayerSample]) -> tuple[float, float, float, float, float]:
    """(launch, matmul, vector) scales, seconds per kernel and the transposes' scale
    minimising the squared relative error, each ≥ 0.

    Exact non-negative least squares for five unknowns: solve every subset of free
    coefficients and keep the best solution whose coefficients are all non-negative."""
    if not samples:
        return 1.0, 1.0, 1.0, 0.0, 1.0
    X = np.array([[s.launch_s, s.matmul_s, s.vector_s, s.kernels, s.transpose_s] for s in samples], dtype=float)
    y = np.array([s.measured_s for s in samples])
    X, y = X / y[:, None], np.ones_like(y)  # relative error
    used = [c for c in range(X.shape[1]) if X[:, c].any()]
    best, best_residual = np.zeros(X.shape[1]), float("inf")
    for k in range(len(used), 0, -1):
        for free in itertools.combinations(used, k):
            coef, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
            if (coef < 0).any():
                continue
            candidate = np.zeros(X.shape[1])
            candidate[list(free)] = coef
            residual = float(np.sum((X @ candidate - y) ** 2))
            if residual < best_residual - 1e-12:
                best, best_residual = candidate, residual
    # A kind of work the samples never exercise keeps its uncorrected time.
    defaults = (1.0, 1.0, 1.0, 0.0, 1.0)
    launch, matmul, vector, kernel, transpose = (float(b) if X[:, i].any() else d for i, (b, d) in enumerate(zip(best, defaults)))
    return launch, matmul, vector, kernel, transpose


def calibrated(model: ComputeModel, samples: Sequence[LayerSample]) -> ComputeModel:
    launch, matmul, vector, kernel, transpose = fit_scales(samples)
    return replace(model, launch_scale=launch, matmul_scale=matmul, vector_scale=vector, op_overhead_s=kernel,
                   transpose_scale=transpose)
