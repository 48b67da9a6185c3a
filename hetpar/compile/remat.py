"""Recomputation: a stage's backward program reruns part of its forward instead of
reading activations the forward program kept for it.

The traced step already holds the backward (the user's `jax.grad`), so a stage's
forward and backward are two programs and the activations the backward reads
(residuals) are outputs of the forward program, held by the runtime for every
microbatch in flight. Recomputing a stage moves forward operators into its backward
program: the forward program then returns only what other stages (or the step's
outputs) need, and the backward recomputes the rest from the stage's inputs. What is
kept follows `jax.checkpoint`'s policies: "full" keeps nothing (`nothing_saveable`),
"dots" keeps matmul results without batch dimensions
(`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, asked per operator).

The last stage runs a microbatch's forward and backward as one program (tasks.py),
so it holds one microbatch's activations only while that program runs; it has no
separate backward to move work into and is left as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax

from hetpar.compile.tasks import Task
from hetpar.errors import PlanError
from hetpar.trace.opgraph import Op, OpGraph
from solver.memory import REMAT_POLICIES



def saveable(policy: str) -> Callable[[Op, OpGraph], bool]:
    """Whether a forward operator's outputs stay saved under `policy` (the rest is
    recomputed): JAX's own checkpoint policy, asked with the operator's primitive,
    operand types and parameters, as `jax.checkpoint` would ask it."""
    if policy not in REMAT_POLICIES:
        raise PlanError(f"unknown recomputation policy {policy!r}; use one of {', '.join(repr(p) for p in REMAT_POLICIES)}")
    if policy == "full":
        return lambda op, graph: False
    if policy == "dots":
        rule = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return lambda op, graph: bool(rule(op.primitive, *(graph.avals[v] for v in op.inputs), **op.params))
    return lambda op, graph: True


def rerun(graph: OpGraph, forward: list[int], wanted: list[int], keep: Callable[[Op, OpGraph], bool]) -> tuple[set[int], set[int]]:
    """(forward operators to rerun, forward values to keep) so that every value in
    `wanted` the `forward` operators make is at hand: walk back from each to a value
    `keep` saves or to the forward's inputs."""
    made_by = {v: i for i in forward for v in graph.ops[i].outputs}
    redo: set[int] = set()
    kept: set[int] = set()
    todo = [v for v in wanted if v in made_by]
    while todo:
        v = todo.pop()
        i = made_by[v]
        if keep(graph.ops[i], graph):
            kept.add(v)
            continue
        if i in redo:
            continue
        redo.add(i)
        todo += [u for u in graph.ops[i].inputs if u in made_by]
    return redo, kept


def recompute(tasks: list[Task], graph: OpGraph, policies: dict[int, str]) -> list[Task]:
    """`tasks` with each stage whose policy (by stage index) is not "" recomputing
    its forward in its backward program. Other stages' tasks are returned as they are."""
    out = list(tasks)
    for stage, policy in policies.items():
        if not policy:
            continue
        keep = saveable(policy)
        at = {(t.kind, t.stage): i for i, t in enumerate(out)}
        if ("fwd", stage) not in at or ("bwd", stage) not in at:
            continue  # the last stage: forward and backward are one program
        fwd, bwd = out[at["fwd", stage]], out[at["bwd", stage]]
        made_by = {v: i for i in fwd.ops for v in graph.ops[i].outputs}
        redo, _ = rerun(graph, fwd.ops, bwd.inputs, keep)
        if not redo:
            continue
        # In trace order, a dependency order: forward operators come first (none reads a
        # backward value), and one both programs remake (compile/remade.py) runs once.
        ops = sorted(redo.union(bwd.ops))
        inputs = graph.read_from_outside(ops)
        members = set(ops) | set(fwd.ops)
        step_outputs = set(graph.outvars)
        fwd_outputs = [v for v in fwd.outputs
                       if v in step_outputs or v in inputs or any(c not in members for c in graph.consumers.get(v, ()))]
        fwd_outputs += [v for v in inputs if v in made_by and v not in fwd_outputs]  # saved values the backward read only through others
        out[at["fwd", stage]] = replace(fwd, outputs=fwd_outputs)
        out[at["bwd", stage]] = replace(bwd, ops=ops, inputs=inputs)
    return out
