"""Cut the traced step into tasks: one program per (stage, kind), where kind is
"pre" (once, before the microbatches), "fwd" and "bwd" (per microbatch) or "post"
(once, on the accumulated reductions).

Correctness does not depend on how good the layer assignment is, only on the task
graph being runnable in schedule order: forward values flow to the same or later
stages, cotangents to the same or earlier stages (layer construction guarantees
both), and pre/post work that crosses stages is ordered by phases.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.compile.remade import remakeable, remake
from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph



@dataclass
class Task:
    kind: str  # "pre" | "fwd" | "bwd" | "post"
    stage: int
    phase: int  # ordering among pre (or post) tasks; 0 for fwd/bwd
    ops: list[int]
    inputs: list[int]  # values read here and produced elsewhere (or step inputs)
    outputs: list[int]  # values produced here and read elsewhere (not reductions)
    reductions: list[int]  # per-microbatch reductions, accumulated over microbatches

    @property
    def name(self) -> str:
        suffix = f".{self.phase}" if self.kind in ("pre", "post") else ""
        return f"{self.kind}{suffix}@stage{self.stage}"

    @property
    def per_microbatch(self) -> bool:
        return self.kind in ("fwd", "bwd")


def build_tasks(graph: OpGraph, analysis: MicrobatchAnalysis, stage: list[int]) -> list[Task]:
    # The last stage runs a microbatch's backward right after its forward, so its two
    # halves are one program: XLA fuses across them and residuals never leave it.
    last = max(stage) if stage else 0
    kind = []
    for op in graph.ops:
        p = analysis.phase[op.index]
        backward = analysis.backward[op.index] and stage[op.index] != last
        kind.append(p.value if p is not Phase.MICRO else ("bwd" if backward else "fwd"))

    # Small values made from the step's inputs alone are remade by their readers on
    # other stages (remade.py): reading one waits for no other stage.
    free = remakeable(graph, analysis)
    phase = [0] * len(graph.ops)
    for op in graph.ops:  # a new phase whenever pre/post work waits on another stage
        if kind[op.index] in ("pre", "post"):
            for v in op.inputs:
                p = graph.producer.get(v)
                if p is not None and p not in free and kind[p] == kind[op.index]:
                    phase[op.index] = max(phase[op.index], phase[p] + (stage[p] != stage[op.index]))

    key_of = [(kind[i], stage[i], phase[i]) for i in range(len(graph.ops))]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(key_of):
        groups.setdefault(key, []).append(i)

    step_outputs = set(graph.outvars)
    tasks = []
    for (k, s, ph), ops in groups.items():
        members = set(ops)
        produced = {v for i in ops for v in graph.ops[i].outputs}
        inputs = graph.read_from_outside(ops)
        reductions = [v for v in sorted(produced) if v in analysis.reductions]
        outputs = [
            v for v in sorted(produced)
            if v not in analysis.reductions
            and (v in step_outputs or any(c not in members for c in graph.consumers.get(v, ())))
        ]
        tasks.append(Task(k, s, ph, ops, inputs, outputs, reductions))
    tasks = remake(tasks, graph, free)
    order = {"pre": 0, "fwd": 1, "bwd": 2, "post": 3}
    tasks.sort(key=lambda t: (order[t.kind], t.phase, t.stage if t.kind != "bwd" else -t.stage))
    return tasks
