"""A stage's configuration as the cost model reads it: its kind, data and tensor
parallelism, hybrid-sharding group and (on two model axes) the collectives its
sharding chose. Its own module so the stage tables (`stage_costs`) and the
topologies its collectives see (`topologies`) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from solver.cost.model_axes import ModelCollective


@dataclass(frozen=True)
class StageConfig:
    kind: str
    dp: int
    tp: int
    zero_group: int = 0  # hybrid sharding: ZeRO over this many of the data axis's devices (a node's); 0: all
    # Two model axes: the collectives its sharding chose, priced in place of Megatron's (solver.cost.model_axes)
    model_collectives: tuple[ModelCollective, ...] = ()

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def hybrid(self) -> bool:
        """ZeRO shards within groups of the data axis and replicates across them."""
        return 0 < self.zero_group < self.dp

    @property
    def zero_shards(self) -> int:
        """The devices a ZeRO stage splits the state over: the group, or the whole data axis."""
        return self.zero_group if self.hybrid else self.dp
