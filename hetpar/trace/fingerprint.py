"""A traced step's fingerprint: its argument and result types and a hash of its
operators. A plan file carries it, so a plan made for one model is never run on
another, and the refusal can say what differs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hetpar.trace.opgraph import OpGraph


@dataclass(frozen=True)
class ProgramSignature:
    """What identifies a traced step: a plan made for one step must not run another."""

    inputs: tuple[str, ...]  # e.g. "f32[32,128]", in flat argument order
    outputs: tuple[str, ...]
    num_operators: int
    digest: str  # hash of the operator sequence (primitives and shapes)


def type_name(aval: Any) -> str:
    shape = ",".join(str(d) for d in getattr(aval, "shape", ()))
    return f"{getattr(aval, 'dtype', type(aval).__name__)}[{shape}]"


def signature(graph: OpGraph) -> ProgramSignature:
    h = hashlib.sha256()
    for op in graph.ops:
        ins = ";".join(type_name(graph.avals[v]) for v in op.inputs)
        outs = ";".join(type_name(graph.avals[v]) for v in op.outputs)
        h.update(f"{op.name}({ins})->{outs}\n".encode())
    return ProgramSignature(
        inputs=tuple(type_name(graph.avals[v]) for v in graph.invars),
        outputs=tuple(type_name(graph.avals[v]) for v in graph.outvars),
        num_operators=len(graph.ops),
        digest=h.hexdigest()[:16],
    )


def differences(expected: ProgramSignature, actual: ProgramSignature, paths: tuple[str, ...] = ()) -> list[str]:
    """What a person needs to see to know why a plan does not fit a step: the first
    argument whose type differs, by its pytree path in `paths` (the step's flat
    arguments' paths, as `TracedStep.input_paths`) where given."""
    out = []
    if len(expected.inputs) != len(actual.inputs):
        out.append(f"the plan's step takes {len(expected.inputs)} arrays, this one {len(actual.inputs)} "
                   "(the arguments' pytree structure differs)")
    else:
        for i, (a, b) in enumerate(zip(expected.inputs, actual.inputs)):
            if a != b:
                where = f"argument {paths[i]}" if i < len(paths) and paths[i] else f"argument leaf {i}"
                out.append(f"{where} is {b} here but {a} in the plan")
                break
    if expected.outputs != actual.outputs and not out:
        out.append(f"the step returns {len(actual.outputs)} arrays ({', '.join(actual.outputs[:3])}...), the plan's {len(expected.outputs)}")
    if expected.num_operators != actual.num_operators:
        out.append(f"the step has {actual.num_operators} operators, the plan's {expected.num_operators}")
    elif expected.digest != actual.digest and not out:
        out.append("the operators differ (same count, different kinds or shapes)")
    return out
