"""The one module that reads jaxprs.

JAX gives no compatibility promise for jaxpr internals, so everything that touches
`Jaxpr`, `JaxprEqn`, `Var` or `Literal` lives here. The rest of hetpar works on
`OpGraph`, a flat list of operators over integer value ids.

Call-like primitives (`jit`, `custom_jvp_call`, `custom_vjp_call`, `remat2`, ...)
are inlined: after autodiff their bodies are ordinary operators, and a flat list
is what layer construction and stage partitioning need. Loop primitives (`scan`,
`while`, `cond`) stay whole: they are one operator whose cost sums its body.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

from hetpar.trace.opgraph import Op, OpGraph

# Primitives whose body is spliced into the caller. Each maps to the param holding it.
_INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


class _Builder:
    """Assigns value ids in traversal order, so two traces of the same program at
    different batch sizes get the same ids for the same values."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.avals: list[Any] = []
        self.constants: dict[int, Any] = {}

    def new_value(self, aval: Any) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def constant(self, value: Any, aval: Any) -> int:
        vid = self.new_value(aval)
        self.constants[vid] = value
        return vid

    def read(self, atom: Any, env: dict) -> int:
        if isinstance(atom, jcore.Literal):
            return self.constant(atom.val, atom.aval)
        return env[atom]

    def splice(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[int], scope: str) -> list[int]:
        env: dict = {}
        for var, const in zip(jaxpr.constvars, consts):
            env[var] = self.constant(const, var.aval)
        for var, vid in zip(jaxpr.invars, args):
            env[var] = vid
        for eqn in jaxpr.eqns:
            inputs = [self.read(a, env) for a in eqn.invars]
            eqn_scope = _join_scope(scope, str(eqn.source_info.name_stack))
            name = eqn.primitive.name
            if name in _INLINED:
                body = eqn.params[_INLINED[name]]
                body_jaxpr, body_consts = _open(body)
                outs = self.splice(body_jaxpr, body_consts, inputs, eqn_scope)
                for var, vid in zip(eqn.outvars, outs):
                    env[var] = vid
                continue
            outputs = tuple(self.new_value(v.aval) for v in eqn.outvars)
            for var, vid in zip(eqn.outvars, outputs):
                env[var] = vid
            self.ops.append(Op(len(self.ops), eqn.primitive, dict(eqn.params), tuple(inputs), outputs, eqn_scope))
        return [self.read(a, env) for a in jaxpr.outvars]


def _open(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) from a closed or open jaxpr (one class since JAX 0.11)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    consts = getattr(jaxpr, "consts", None)
    return inner, (consts if consts is not None else ())


def _join_scope(outer: str, inner: str) -> str:
    if not outer:
        return inner
    if not inner:
        return outer
    return f"{outer}/{inner}"


def trace(fn: Callable, *args: Any) -> OpGraph:
    """Traces `fn(*args)` (arrays or ShapeDtypeStructs) into a flat OpGraph."""
    closed = jax.make_jaxpr(fn, return_shape=False)(*args)
    in_leaves, in_tree = jax.tree.flatten(args)
    out_shape = jax.eval_shape(fn, *args)
    _, out_tree = jax.tree.flatten(out_shape)
    builder = _Builder()
    jaxpr, consts = _open(closed)
    invars = [builder.new_value(v.aval) for v in jaxpr.invars]
    outvars = builder.splice(jaxpr, consts, invars, "")
    return OpGraph(
        ops=_live_ops(builder.ops, outvars),
        avals=builder.avals,
        constants=builder.constants,
        invars=invars,
        outvars=outvars,
        in_tree=in_tree,
        out_tree=out_tree,
    )


def _live_ops(ops: list[Op], outvars: list[int]) -> list[Op]:
    """Drops operators whose results nothing uses (tracing keeps, e.g., the tangents
    of auxiliary outputs), renumbering the rest; effectful operators stay."""
    needed = set(outvars)
    keep = []
    for op in reversed(ops):
        if op.primitive.name in _EFFECTFUL or any(v in needed for v in op.outputs):
            keep.append(op)
            needed.update(op.inputs)
    return [Op(i, op.primitive, op.params, op.inputs, op.outputs, op.scope) for i, op in enumerate(reversed(keep))]


_EFFECTFUL = {"debug_callback", "io_callback", "debug_print"}


def bind(op: Op, args: Sequence[Any]) -> list[Any]:
    """Applies one operator; works under any JAX trace (jit, eval)."""
    out = op.primitive.bind(*args, **op.primitive.get_bind_params(op.params))
    return list(out) if op.primitive.multiple_results else [out]


def open_jaxpr(jaxpr: Any) -> Any:
    return _open(jaxpr)[0]


def jaxpr_ops(jaxpr: Any) -> list[tuple[str, list[Any], list[Any], dict]]:
    """(primitive name, input avals, output avals, params) per equation of a nested
    jaxpr (a loop body); used to cost it without building an OpGraph for it."""
    return [
        (e.primitive.name, [a.aval for a in e.invars], [v.aval for v in e.outvars], e.params)
        for e in jaxpr.eqns
    ]

