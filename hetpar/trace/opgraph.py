"""OpGraph: a traced train step as plain data.

Values are integer ids; each operator reads and writes ids. Ids are assigned in
traversal order, so two traces of one program at different batch sizes align id for
id; hetpar compares them to learn which values carry the batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True, eq=False)
class Op:
    index: int
    primitive: Any  # a jax Primitive; opaque outside hetpar.trace.jaxpr_ir
    params: dict
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scope: str  # JAX's name stack, e.g. "transpose(jvp(GPT))/Block_3/attn"
    source: Any = field(default=None, repr=False, compare=False)  # JAX's record of the user code that made it

    @property
    def where(self) -> str:
        """The user's line that made this operator, e.g. "train.py:41 (loss_fn)", so
        that a refusal points at the code to change; "" when JAX kept no record."""
        if self.source is None:
            return ""
        from jax.extend import source_info_util

        return source_info_util.summarize(self.source)

    def describe(self) -> str:
        """How error messages name the operator: its primitive, module scope and line."""
        where = self.where
        return f"operator {self.name!r} (in {self.scope or 'the step'}" + (f", at {where})" if where else ")")

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def is_backward(self) -> bool:
        return "transpose(" in self.scope

    @property
    def module_path(self) -> tuple[str, ...]:
        """The flax module path of the op, with autodiff wrappers removed:
        "transpose(jvp(GPT))/Block_3/attn" -> ("GPT", "Block_3", "attn")."""
        parts = []
        for part in self.scope.split("/"):
            while "(" in part and part.endswith(")"):
                part = part[part.index("(") + 1 : -1]
            if part:
                parts.append(part)
        return tuple(parts)


@dataclass
class OpGraph:
    ops: list[Op]
    avals: list[Any]  # per value id: a ShapedArray
    constants: dict[int, Any]  # value id -> literal or captured constant
    invars: list[int]
    outvars: list[int]
    in_tree: Any
    out_tree: Any
    _cache: dict = field(default_factory=dict, repr=False)

    @cached_property
    def producer(self) -> dict[int, int]:
        """value id -> index of the op that writes it."""
        return {v: op.index for op in self.ops for v in op.outputs}

    @cached_property
    def consumers(self) -> dict[int, list[int]]:
        """value id -> indices of the ops that read it (in order)."""
        out: dict[int, list[int]] = {}
        for op in self.ops:
            for v in op.inputs:
                out.setdefault(v, []).append(op.index)
        return out

    def read_from_outside(self, ops: list[int]) -> list[int]:
        """The values operators `ops` read that none of them makes and that are not
        constants, in the order first read: a program's arguments, for every way a
        task's operators are chosen (cut by stage, recomputed, remade)."""
        made = {v for i in ops for v in self.ops[i].outputs}
        return list(dict.fromkeys(v for i in ops for v in self.ops[i].inputs
                                  if v not in made and v not in self.constants))

    def nbytes(self, value: int) -> int:
        aval = self.avals[value]
        size = 1
        for d in getattr(aval, "shape", ()):
            size *= int(d)
        return size * getattr(getattr(aval, "dtype", None), "itemsize", 0)

    def structure(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        return [(op.name, op.inputs, op.outputs) for op in self.ops]
