"""How a step's state round-trips through the NVMe tier (the store: nvme_store.py).

hetpar's step is functional: state in, new state out. Under the NVMe tier the new
optimizer state of an `offload="nvme"` stage must not stay in memory after the
step, so the runtime returns, in its leaves' places, `NvmeArray` handles (a store,
a generation, a key: no bytes), and:

- after the step (`NvmeOutputs.commit`): the stage's new state, which its update
  program left in host memory (`pinned_host`, as under host offload), is written
  array by array as the store's next generation and committed; the arrays are then
  dropped, so neither device nor host memory holds it between steps;
- in the next step (`loading`): the interpreter asks the transport to move each
  argument where its program wants it; a handle is read from its file there, shard
  by shard, into that layout (host memory), just before the update that reads it.
  The update program moves it to the devices, as under host offload.

User code that reads those leaves gets real arrays or a clear error:
`np.asarray(leaf)`, `hetpar.gather(state)` and `hetpar.save_checkpoint(state)` read
the files; a handle whose generation the store no longer keeps is refused by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetpar.runtime.nvme_store import NvmeArray, NvmeStore

log = logging.getLogger("hetpar.nvme")


@dataclass
class NvmeOutputs:
    """The step outputs (positions in the flat outputs) an NVMe-tier stage returns
    as its new optimizer state, and the store they go to."""

    positions: tuple[int, ...]
    store: NvmeStore

    def commit(self, outputs: list) -> list:
        """`outputs` with the NVMe-tier state written as one new generation and
        replaced by handles. Raises (leaving the store at its previous generation,
        which the caller's state still names) if the write fails."""
        arrays = {f"out{i}": outputs[i] for i in self.positions}
        handles = self.store.write(arrays)
        out = list(outputs)
        for i in self.positions:
            out[i] = handles[f"out{i}"]
        log.debug("wrote NVMe generation %d (%d arrays) to %s", next(iter(handles.values())).generation if handles else 0,
                  len(handles), self.store.root)
        return out


def nvme_positions(outvars: Sequence[int], plan: Any) -> tuple[int, ...]:
    """Positions among the step's outputs of the new optimizer state that
    `offload="nvme"` stages of `plan` keep on the NVMe tier."""
    kept = {new for s in plan.stages if s.offload == "nvme" for _, new in s.offloaded}
    return tuple(i for i, v in enumerate(outvars) if v in kept)


def has_handles(flat: Sequence[Any]) -> bool:
    return any(isinstance(x, NvmeArray) for x in flat)


def readable(flat: Sequence[Any]) -> list:
    """`flat` with every handle read into host memory (for tracing a new shape: the
    tracer needs arrays, not handles)."""
    return [x.read() if isinstance(x, NvmeArray) else x for x in flat]


def loading(move: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A transport's `move` that reads a handle from its file into the layout the
    program wants (its memory kind included), and moves anything else as `move` does."""
    def move_or_load(x: Any, target: Any) -> Any:
        if isinstance(x, NvmeArray):
            return x.load(target)
        return move(x, target)

    return move_or_load
