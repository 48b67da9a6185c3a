"""Host offload: a stage's optimizer state kept in host memory (JAX's `pinned_host`
memory kind) between steps, moved to its devices for the update. Parity with one
device with it forced (one and two stages, with and without ZeRO), the plan
field's round trip, where the arrays really live, and the planner offloading only
where device memory alone does not hold the model."""

from __future__ import annotations

import jax
import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.options import ShardingOption, StageOption
from hetpar.plan.file import load_plan, save_plan
from models import mlp
from parity import run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
HOST = StageOption(mode="uniform", offload="host")


def _mlp():
    return mlp.setup(batch_size=16, hidden=32, depth=3)  # Adam (adamw), as every reference model


def _kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree) if getattr(leaf, "ndim", 0) >= 1}


@pytest.mark.parametrize("stages, zero", [(1, 0), (2, 0), (2, 1), (2, 3)])
def test_offload_parity(stages, zero):
    cluster = hetpar.Cluster.virtual({"A100": 4} if stages == 1 else TWO_TYPES)
    plan = run_parity(_mlp(), cluster, steps=2, num_stages=stages, num_layers=4, num_microbatches=2, stage_option=HOST,
                      sharding_option=ShardingOption(zero=zero))
    for stage in plan.stages:
        assert stage.offload == "host" and stage.offloaded and stage.zero == zero
        assert stage.host_bytes > 0
