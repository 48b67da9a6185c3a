"""How a step's state round-trips through the NVMe tier (the store: nvme_store.py).

hetpar's step is functional: state in, new state out. Under the NVMe tier the new
optimizer state of an `offload="nvme"` stage must not stay in memory after the
step, so the runtime returns, in its leaves' places, `NvmeArray` handles (a store,
a generation, a key: no bytes). One step (`NvmeRun`, its `NvmeTransport` wrapping the transport the
interpreter runs over):

- reads: the interpreter asks the transport to move each argument where its program
  wants it; a handle is read from its file there, shard by shard, into that layout
  (the update's `pinned_host` one, as under host offload), when the stage's update is
  about to run. The update program moves it to the devices. Once the update is
  dispatched, the copy read is deleted (freed when the update is done with it);
- writes: as soon as a program returns new NVMe-tier state, each array goes to a
  worker thread that writes it into the step's generation (so the interpreter goes on
  dispatching other stages' programs while the disk works), and the store keeps a
  handle in its place; the array is freed when written;
- the commit: after the last program, the runtime waits for the writes and switches
  the store's manifest to the new generation. A step that raises first commits
  nothing: the state it was given stays the valid one.

User code that reads those leaves gets real arrays or a clear error:
`np.asarray(leaf)`, `hetpar.gather(state)` and `hetpar.save_checkpoint(state)` read
the files; a JAX operation on a handle refuses it by type; a handle whose generation
the store no longer keeps is refused by name.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from hetpar.runtime.nvme_store import GenerationWriter, NvmeArray, NvmeStore

log = logging.getLogger("hetpar.nvme")


def nvme_values(plan: Any) -> frozenset[int]:
    """The values (new optimizer state) that `offload="nvme"` stages of `plan` keep
    on the NVMe tier between steps."""
    return frozenset(new for s in plan.stages if s.offload == "nvme" for _, new in s.offloaded)


def has_handles(flat: Sequence[Any]) -> bool:
    return any(isinstance(x, NvmeArray) for x in flat)


def readable(flat: Sequence[Any]) -> list:
    """`flat` with every handle read into host memory (for tracing a new shape: the
    tracer needs arrays, not handles)."""
    return [x.read() if isinstance(x, NvmeArray) else x for x in flat]


class NvmeRun:
    """One step's NVMe-tier work over a transport: handles read where programs want
    them, new state written as it is made, one generation committed at the end."""

    def __init__(self, step: Any, values: frozenset[int], store: NvmeStore | None):
        self.step, self.values = step, values
        self.writer: GenerationWriter | None = store.begin(background=True) if store is not None and values else None
        self.loaded: dict[int, Any] = {}  # id -> an array read from a handle, until its program is dispatched
        # New state another program of the step still reads (an update split over two programs):
        # written once the step is done, from its outputs, not as soon as it is made.
        readers: dict[int, int] = {}  # value -> programs that read it
        fused = set(step.fused_posts.values())  # run inside their host's fused program, not as their own
        programs = [t.inputs for i, t in enumerate(step.tasks) if i not in fused]
        for inputs in programs + [(*f.inputs, *f.post_inputs) for f in step.fusions.values()]:
            for v in set(inputs):
                readers[v] = readers.get(v, 0) + 1
        self.streamed = frozenset(v for v in values if v not in readers)
        self.read_once = frozenset(v for v, n in readers.items() if n == 1)

    def over(self, transport: Any) -> "NvmeTransport":
        """`transport` as the interpreter runs this step over it: with handles read
        where programs want them and new state written as programs make it."""
        return NvmeTransport(transport, self)

    def dispatched(self, values: Sequence[int], args: list) -> None:
        """Deletes the arrays read from handles that this program, their only reader,
        was given (a deleted array's buffer lives until the program using it is done)."""
        if not self.loaded:
            return
        for v, x in zip(values, args):
            if v in self.read_once and self.loaded.pop(id(x), None) is not None:
                x.delete()

    def written(self, values: Sequence[int], outs: Sequence[Any]) -> Sequence[Any]:
        """`outs` with each NVMe-tier value handed to the writer and a handle in its place."""
        if self.writer is None or not any(v in self.streamed for v in values):
            return outs
        return [self.writer.add(f"v{v}", x) if v in self.streamed else x for v, x in zip(values, outs)]

    def commit(self, outputs: list) -> list:
        """The step's outputs with the NVMe-tier state not yet written written, after
        waiting for every write; the generation committed."""
        if self.writer is None:
            return outputs
        outputs = [self.writer.add(f"v{v}", x) if v in self.values and not isinstance(x, NvmeArray) else x
                   for v, x in zip(self.step.graph.outvars, outputs)]
        self.writer.commit()
        log.debug("committed NVMe generation %d to %s", self.writer.generation, self.writer.store.root)
        return outputs

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


class NvmeTransport:
    """A transport (interpreter.Transport) whose moves read NVMe handles and whose
    program calls hand new NVMe-tier state to the step's writer; everything else is
    the wrapped transport's."""

    def __init__(self, inner: Any, run: NvmeRun):
        self.inner, self.run = inner, run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def move(self, x: Any, target: Any) -> Any:
        if isinstance(x, NvmeArray):
            out = x.load(target)
            self.run.loaded[id(out)] = out
            return out
        return self.inner.move(x, target)

    def call(self, program: int, acc: Any, args: list, last: bool) -> tuple:
        outs, acc = self.inner.call(program, acc, args, last)
        task = self.run.step.tasks[program]
        if not task.per_microbatch:  # a later microbatch would reuse its arguments
            self.run.dispatched(task.inputs, args)
        if self.run.step.replica_of and self.run.step.replica_of[program] > 0:
            return outs, acc  # another replica's update: bit for bit replica 0's state, which replica 0 writes
        return self.run.written(task.outputs, outs), acc

    def call_fused(self, program: int, acc: Any, args: list) -> tuple:
        outs, finals, updated = self.inner.call_fused(program, acc, args)
        fused = self.run.step.fusions[program]
        self.run.dispatched((*fused.inputs, *fused.post_inputs), args)
        return (self.run.written(self.run.step.tasks[program].outputs, outs), finals,
                self.run.written(fused.post.outputs, updated))
