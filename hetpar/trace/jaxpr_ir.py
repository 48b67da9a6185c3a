"""The one module that reads jaxprs.

JAX gives no compatibility promise for jaxpr internals, so everything that touches
`Jaxpr`, `JaxprEqn`, `Var` or `Literal` lives here. The rest of hetpar works on
`OpGraph`, a flat list of operators over integer value ids.

Call-like primitives (`jit`, `custom_jvp_call`, `custom_vjp_call`, `remat2`, ...)
are inlined: after autodiff their bodies are ordinary operators, and a flat list
is what layer construction and stage partitioning need. Loop primitives (`scan`,
`while`, `cond`) stay whole: they are one operator whose cost sums its body; except a
`scan` over layers (flax `nn.scan`, `jax.lax.scan` over stacked weights), which is
unrolled so that stages can take iterations i..j of it (`_unroll_scan`).
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


# A scan over more iterations than this is not a stack of layers (a loop over the
# entries of a parameter, say): it stays one operator rather than growing the graph.
_MAX_UNROLLED_LAYERS = 1024


class _Builder:
    """Assigns value ids in traversal order, so two traces of the same program at
    different batch sizes get the same ids for the same values."""

    def __init__(self, unroll_layer_scans: bool = False) -> None:
        self.ops: list[Op] = []
        self.avals: list[Any] = []
        self.constants: dict[int, Any] = {}
        # For recognizing scans over layers: values computed from the batch, and
        # values computed from the other step inputs (parameters) alone.
        self.unroll_layer_scans = unroll_layer_scans
        self.batch_derived: set[int] = set()
        self.param_derived: set[int] = set()
        self.stacks: dict[int, list[int]] = {}  # an unrolled scan's stacked output -> its per-iteration values
        self.slices: dict[tuple[int, int], int] = {}  # (stacked value, iteration) -> the slice read by it

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

    def splice(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[int], scope: str, tag: str = "") -> list[int]:
        """Appends `jaxpr`'s equations applied to `args`; `tag` (an unrolled scan's
        iteration, e.g. "ScanBlock_0[2]") becomes the first module of their scopes."""
        env: dict = {}
        for var, const in zip(jaxpr.constvars, consts):
            env[var] = self.constant(const, var.aval)
        for var, vid in zip(jaxpr.invars, args):
            env[var] = vid
        for eqn in jaxpr.eqns:
            inputs = [self.read(a, env) for a in eqn.invars]
            eqn_scope = _join_scope(scope, _tagged(str(eqn.source_info.name_stack), tag))
            name = eqn.primitive.name
            if name == "scan" and self.unroll_layer_scans and self._over_layers(eqn, inputs):
                for var, vid in zip(eqn.outvars, self._unroll_scan(eqn, inputs, eqn_scope)):
                    env[var] = vid
                continue
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
            self.ops.append(Op(len(self.ops), eqn.primitive, dict(eqn.params), tuple(inputs), outputs, eqn_scope, eqn.source_info))
            if any(v in self.batch_derived for v in inputs):
                self.batch_derived.update(outputs)
            elif any(v in self.param_derived for v in inputs):
                self.param_derived.update(outputs)
        return [self.read(a, env) for a in jaxpr.outvars]

    def _over_layers(self, eqn: Any, inputs: list[int]) -> bool:
        """A scan over layers reads stacked weights as its scanned inputs: some `xs`
        computed from parameters alone (a scan over time reads the batch as `xs` and
        its weights as constants, and stays whole)."""
        _, _, xs = _scan_parts(eqn.params, inputs)
        return int(eqn.params["length"]) <= _MAX_UNROLLED_LAYERS and any(v in self.param_derived for v in xs)

    def _unroll_scan(self, eqn: Any, inputs: list[int], scope: str) -> list[int]:
        """The scan's body once per iteration, in the scan's order, each reading its
        slice of the scanned inputs; stacked outputs are the iterations' results
        stacked (an unrolled scan reading them takes each iteration's value directly,
        so a backward scan reads its forward's residuals without a stack between them).
        Every iteration's operators carry its index in their scope, so layers can be
        cut between iterations and the planner sees each iteration's cost."""
        consts, carry, xs = _scan_parts(eqn.params, inputs)
        body, body_consts = _open(eqn.params["jaxpr"])
        length = int(eqn.params["length"])
        name = _body_module(body)
        per_iteration: dict[int, list[int]] = {}
        order = range(length - 1, -1, -1) if eqn.params["reverse"] else range(length)
        for t in order:
            tag = f"{name}[{t}]"
            sliced = [self._slice(x, t, _join_scope(scope, tag)) for x in xs]
            outs = self.splice(body, body_consts, consts + carry + sliced, scope, tag)
            carry, per_iteration[t] = outs[: len(carry)], outs[len(carry):]
        ys = []
        for j in range(len(eqn.outvars) - len(carry)):
            ys.append(self._stack([per_iteration[t][j] for t in range(length)], scope))
        return carry + ys

    def _slice(self, stacked: int, t: int, scope: str) -> int:
        if stacked in self.stacks:
            return self.stacks[stacked][t]
        if (stacked, t) not in self.slices:
            aval = self.avals[stacked]
            closed = jax.make_jaxpr(lambda a: jax.lax.index_in_dim(a, t, keepdims=False))(
                jax.ShapeDtypeStruct(aval.shape, aval.dtype))
            (self.slices[(stacked, t)],) = self.splice(*_open(closed), [stacked], scope)
        return self.slices[(stacked, t)]

    def _stack(self, values: list[int], scope: str) -> int:
        specs = [jax.ShapeDtypeStruct(self.avals[v].shape, self.avals[v].dtype) for v in values]
        closed = jax.make_jaxpr(lambda *a: jax.numpy.stack(a))(*specs)
        (stacked,) = self.splice(*_open(closed), values, scope)
        self.stacks[stacked] = values
        return stacked


def _scan_parts(params: dict, inputs: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A scan's inputs as (constants, initial carry, scanned inputs). JAX 0.12 keeps
    the split in a flat tree (`ft_in`); earlier versions in `num_consts`/`num_carry`."""
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].update(list(inputs)).unpack()
        return list(consts), list(carry), list(xs)
    nc, nk = int(params["num_consts"]), int(params["num_carry"])
    return list(inputs[:nc]), list(inputs[nc : nc + nk]), list(inputs[nc + nk :])


def _body_module(body: Any) -> str:
    """The module a scan body runs (flax `nn.scan`: "ScanBlock_0"): the most common
    first scope of its equations; "scan" for a body outside any module."""
    counts: dict[str, int] = {}
    for e in body.eqns:
        first = str(e.source_info.name_stack).split("/")[0]
        if first:
            counts[first] = counts.get(first, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "scan"


def _tagged(inner: str, tag: str) -> str:
    """`inner` (a body equation's scope) inside iteration `tag`: its first module
    becomes the tag when it is the body's module ("ScanBlock_0/Dense_0" ->
    "ScanBlock_0[2]/Dense_0"), else the tag is put in front."""
    if not tag:
        return inner
    first, _, rest = inner.partition("/")
    if first and tag.startswith(first + "["):
        return f"{tag}/{rest}" if rest else tag
    return f"{tag}/{inner}" if inner else tag


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


def trace(fn: Callable, *args: Any, batch_leaves: Sequence[int] | None = None) -> OpGraph:
    """Traces `fn(*args)` (arrays or ShapeDtypeStructs) into a flat OpGraph. With
    `batch_leaves` (the flat indices of the batch's leaves), scans over layers are
    unrolled: scans whose scanned inputs include values computed from the other
    inputs (the parameters) alone."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)  # one trace gives both
    in_leaves, in_tree = jax.tree.flatten(args)
    _, out_tree = jax.tree.flatten(out_shape)
    builder = _Builder(unroll_layer_scans=batch_leaves is not None)
    jaxpr, consts = _open(closed)
    invars = [builder.new_value(v.aval) for v in jaxpr.invars]
    if batch_leaves is not None:
        batch = set(batch_leaves)
        builder.batch_derived.update(v for i, v in enumerate(invars) if i in batch)
        builder.param_derived.update(v for i, v in enumerate(invars) if i not in batch)
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
    return [Op(i, op.primitive, op.params, op.inputs, op.outputs, op.scope, op.source) for i, op in enumerate(reversed(keep))]


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

