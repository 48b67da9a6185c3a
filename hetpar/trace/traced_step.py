"""Trace a train step the way every later pass needs it: at the full batch, at twice
the batch (to tell which values carry it), and at the microbatch size the stage
programs run with."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax

from hetpar.errors import HetparError, PlanError, UnsupportedStepError
from hetpar.trace import jaxpr_ir
from hetpar.trace.microbatch import MicrobatchAnalysis, analyze, check_same_structure
from hetpar.trace.opgraph import OpGraph


@dataclass(frozen=True)
class TracedStep:
    full: OpGraph  # at the full batch: its constants are the ones programs use
    exec_graph: OpGraph  # at one microbatch: the shapes programs run with
    analysis: MicrobatchAnalysis
    batch_invars: tuple[int, ...]
    batch_size: int
    microbatch_size: int
    input_paths: tuple[str, ...] = ()  # per flat argument: its pytree path, e.g. "[0].params['Dense_0']['kernel']"


def trace_step(fn: Callable, args: tuple, batch_argnum: int, num_microbatches: int) -> TracedStep:
    batch_size, batch_leaves = batch_size_of(args, batch_argnum, num_microbatches)
    mb = batch_size // num_microbatches
    full = jaxpr_ir.trace(fn, *at_batch(args, batch_argnum, batch_size), batch_leaves=batch_leaves)
    if not full.outvars:
        raise UnsupportedStepError(
            "the step returns no arrays, so there is nothing to compute in parallel; a train step returns "
            "the new state (and usually the loss): return them"
        )
    probe = jaxpr_ir.trace(fn, *at_batch(args, batch_argnum, 2 * batch_size), batch_leaves=batch_leaves)
    exec_graph = full if mb == batch_size else jaxpr_ir.trace(fn, *at_batch(args, batch_argnum, mb), batch_leaves=batch_leaves)
    batch_invars = tuple(full.invars[i] for i in batch_leaves)
    analysis = analyze(full, probe, list(batch_invars), num_microbatches)
    if exec_graph is not full:
        _check_microbatch_program(full, exec_graph, mb)
    paths = tuple(jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(args)[0])
    return TracedStep(full, exec_graph, analysis, batch_invars, batch_size, mb, paths)


def trace_microbatch(fn: Callable, args: tuple, batch_argnum: int, traced: TracedStep, size: int) -> OpGraph:
    """The step traced at another microbatch size (a data-parallel replica's), checked
    to be the same program as the full batch's."""
    if size == traced.microbatch_size:
        return traced.exec_graph
    _, batch_leaves = batch_size_of(args, batch_argnum, 1)
    graph = traced.full if size == traced.batch_size else jaxpr_ir.trace(
        fn, *at_batch(args, batch_argnum, size), batch_leaves=batch_leaves)
    _check_microbatch_program(traced.full, graph, size)
    return graph


def _check_microbatch_program(full: OpGraph, microbatch: OpGraph, size: int) -> None:
    try:
        check_same_structure(full, microbatch)
    except UnsupportedStepError:
        hint = (
            " JAX traces size-1 dimensions differently (broadcasting), so microbatches of one example "
            "do not line up with the full batch: use fewer microbatches or a larger batch."
            if size == 1 else ""
        )
        raise UnsupportedStepError(
            f"the step traces to a different program at the microbatch size {size} than at the full batch.{hint}"
        ) from None


def as_array(x: Any) -> Any:
    return x if hasattr(x, "shape") else jax.numpy.asarray(x)


def batch_size_of(args: tuple, batch_argnum: int, num_microbatches: int) -> tuple[int, list[int]]:
    """The batch size and the flat indices of the batch's leaves."""
    if batch_argnum >= len(args):
        raise HetparError(f"the step got {len(args)} arguments; batch_argnum={batch_argnum} names none of them")
    before = sum(len(jax.tree.leaves(a)) for a in args[:batch_argnum])
    leaves = jax.tree.leaves(args[batch_argnum])
    if not leaves:
        raise HetparError("the batch argument has no arrays")
    sizes = {int(as_array(x).shape[0]) if as_array(x).ndim else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise HetparError(f"every leaf of the batch needs the same leading batch dimension; got sizes {sorted(map(str, sizes))}")
    (size,) = sizes
    if size % num_microbatches:
        raise PlanError(
            f"batch size {size} is not divisible by num_microbatches={num_microbatches}; "
            f"pick a microbatch count that divides it (e.g. {_divisor_near(size, num_microbatches)})"
        )
    return size, list(range(before, before + len(leaves)))


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


def at_batch(args: tuple, batch_argnum: int, size: int) -> tuple:
    """Abstract arguments with the batch's leading dimension set to `size`."""
    def spec(x: Any, batch: bool) -> jax.ShapeDtypeStruct:
        x = as_array(x)
        shape = (size, *x.shape[1:]) if batch else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype)

    return tuple(
        jax.tree.map(functools.partial(spec, batch=i == batch_argnum), a) for i, a in enumerate(args)
    )
