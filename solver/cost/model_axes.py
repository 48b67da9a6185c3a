"""A stage's tensor-parallel communication as its sharding chose it, for a stage
whose tensor parallelism spans two model axes (3D tensor parallelism).

The estimator prices a stage's tensor parallelism from each layer's Megatron
estimate (`LayerCost.tp_bytes`: two all-reduces of the activation per pass over
one model axis). That is the collectives of a one-axis split, not of a matmul split
over rows, contraction and columns on three axes, whose operands move as
all-gathers over one axis and whose partial sums are all-reduced over another, each
over a few devices. A stage on such a mesh carries the collectives its sharding
solver chose (`ModelCollective`: which layer and pass runs each, over how many
devices, how many bytes per device), and the estimator prices them here through the
collective registry, so the step time a plan reports follows its layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.collectives import LinkCost, Topology, best


@dataclass(frozen=True)
class ModelCollective:
    """One collective the stage's layouts run per microbatch: in layer `layer`'s
    forward or backward, `collective` ("all_reduce", "all_gather") over `devices` of
    one model (or data) axis, each device's message `nbytes` plus `bytes_per_example`
    for every example of the stage's microbatch (an activation's; a weight's is
    fixed), `count` times."""

    layer: int
    backward: bool
    collective: str
    devices: int
    nbytes: float
    bytes_per_example: float = 0.0
    count: int = 1

    def message_bytes(self, examples: float) -> float:
        """One call's bytes per device on a microbatch of `examples`."""
        return self.nbytes + self.bytes_per_example * examples


def collective_s(c: ModelCollective, link: LinkCost, examples: float) -> tuple[str, float]:
    """(algorithm, seconds of all `count` calls) of one collective over devices of
    one node joined by `link`, as the registry's fastest algorithm runs it."""
    algorithm, seconds = best(c.collective, Topology(1, c.devices, link, link), c.message_bytes(examples))
    return algorithm, c.count * seconds


def model_comm_s(collectives: tuple[ModelCollective, ...], link: LinkCost, examples: float,
                 num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the forward's and the backward's seconds of the stage's recorded
    collectives on a microbatch of `examples` (layers without any: 0)."""
    forward, backward = np.zeros(num_layers), np.zeros(num_layers)
    for c in collectives:
        (backward if c.backward else forward)[c.layer] += collective_s(c, link, examples)[1]
    return forward, backward
