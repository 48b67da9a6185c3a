"""Hybrid sharding (HSDP, #35 item 4): ZeRO over the devices of a node with replicas
across nodes. A stage's `zero_group` splits its data axis into `replica` x `zero`:
parameters and optimizer state shard over `zero` only, examples over both; it runs
with jax.jit's numbers on a two-node virtual cluster, the estimator prices only one
node-shard's gradient all-reduce across nodes, and the plan file records and checks it."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.options import ShardingOption, StageOption
from hetpar.plan.costs import decisions
from hetpar.plan.file import load_plan, save_plan
from models import mlp
from parity import run_parity
from solver.cost.collectives_used import across_node_bytes, collectives_used
from solver.cost.stage_costs import StageCosts
from solver.cost.topologies import across_nodes_s, across_topology

TWO_NODES = """\
name: two-nodes
groups:
  - name: nodes
    device: A100
    nodes: 2
    devices_per_node: 4
    inter_node: {bandwidth: 12.5e9, latency: 1e-5}
"""


def _cluster(tmp_path) -> hetpar.Cluster:
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(TWO_NODES))
    return hetpar.Cluster.from_file(str(path))


def _mlp():
    return mlp.setup(batch_size=16, hidden=32, depth=3)


def _plan(tmp_path, zero_group: int = 4, zero: int = 3) -> hetpar.Plan:
    workload = _mlp()
    return hetpar.make_plan(workload.step, (workload.state, workload.batch), _cluster(tmp_path), num_stages=1,
                            num_microbatches=1, mesh_shape=(8, 1), sharding_option=ShardingOption(zero=zero, zero_group=zero_group))


@pytest.mark.parametrize("zero, microbatches", [(3, 2), (2, 1)])
def test_hybrid_zero_parity_two_nodes(tmp_path, zero, microbatches):
    """ZeRO within each node of four devices, two replicas across the nodes: two
    steps (sharded state carried across steps) give jax.jit's numbers."""
    plan = run_parity(_mlp(), _cluster(tmp_path), steps=2, num_stages=1, num_microbatches=microbatches, mesh_shape=(8, 1),
                      sharding_option=ShardingOption(zero=zero, zero_group=4))
    (stage,) = plan.stages
    assert stage.zero == zero and stage.zero_group == 4
    axes = {a for _, spec in stage.shardings for a in spec if a}
    assert "zero" in axes and "data" not in axes  # state sharded within the node only
    assert bool(stage.gathered) == (zero == 3)


def test_hybrid_two_stages_parity(tmp_path):
    """Two pipeline stages, each a node of four devices as two replicas of two-way
    ZeRO-3 (groups smaller than a node), 1F1B."""
    plan = run_parity(_mlp(), _cluster(tmp_path), steps=2, num_stages=2, num_layers=4, num_microbatches=2, schedule="1f1b",
                      stage_option=StageOption(mode="uniform"), sharding_option=ShardingOption(zero=3, zero_group=2))
    assert [(s.zero, s.zero_group, s.num_devices) for s in plan.stages] == [(3, 2, 4), (3, 2, 4)]


def test_hybrid_runtime_state_is_sharded_within_node_replicated_across(tmp_path):
    workload = _mlp()
    par = hetpar.parallelize(workload.step, cluster=_cluster(tmp_path), num_stages=1, num_microbatches=1, mesh_shape=(8, 1),
                             sharding_option=ShardingOption(zero=3, zero_group=4))
    state, _ = par(workload.state, workload.batch)
    kernel = state.params["params"]["Block_1"]["Dense_0"]["kernel"]  # the hidden 32x32 weight
    assert kernel.sharding.mesh.shape == {"replica": 2, "zero": 4}
    assert "zero" in kernel.sharding.spec and "replica" not in tuple(kernel.sharding.spec)
    # each device holds a quarter: the shard of its node's group, the same on both nodes
    assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 4}


def test_across_node_bytes_are_one_node_shard_gradient_allreduce(tmp_path):
    """Priced across nodes per step: the all-reduce of one node's shard of the gradient
    (1/4 of it) and nothing else; ZeRO-3 over the whole 8-device axis instead sends
    its gathers and scatters across nodes, far more."""
    hybrid = _plan(tmp_path)
    problem = hybrid.cost_inputs
    cost = StageCosts(problem)
    grads = float(cost.tp_params(1).sum())  # the stage holds every layer
    assert across_node_bytes(problem, decisions(hybrid)) == pytest.approx(grads / 4)
    crossing = [u for u in collectives_used(problem, decisions(hybrid)) if u.nodes > 1]
    assert [(u.collective, u.devices, u.calls) for u in crossing] == [("all_reduce", 2, 1)]
    assert all(u.nodes == 1 for u in collectives_used(problem, decisions(hybrid)) if u.collective != "all_reduce")
    whole = _plan(tmp_path, zero_group=0)
    assert whole.stages[0].zero_group == 0
    assert across_node_bytes(problem, decisions(whole)) > 2 * grads  # gathered twice and scattered, across nodes
    # the estimator prices the two differently: hybrid holds 4x the state of 8-way ZeRO-3, in exchange for less traffic
    from hetpar.plan.costs import estimate_plan
    h, w = estimate_plan(hybrid).stages[0], estimate_plan(whole).stages[0]
    assert h.memory.parameters == pytest.approx(2 * w.memory.parameters)


def test_hybrid_plan_round_trip_and_bad_group(tmp_path):
    plan = _plan(tmp_path)
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan and loaded.stages[0].zero_group == 4
    raw = json.loads((tmp_path / "plan.json").read_text())
    raw["stages"][0]["zero_group"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="zero_group 3 does not divide"):
        load_plan(tmp_path / "bad.json")


def test_hybrid_option_not_a_divisor_is_refused(tmp_path):
    with pytest.raises(PlanError, match=r"zero_group 3 does not divide its data axis of 8.*\[1, 2, 4\]"):
        _plan(tmp_path, zero_group=3)
    with pytest.raises(PlanError, match="ShardingOption.zero_group"):
        _plan(tmp_path, zero_group=-1)


def test_zero_group_at_or_above_the_data_axis_is_plain_zero(tmp_path):
    plan = _plan(tmp_path, zero_group=8)
    assert plan.stages[0].zero_group == 0 and plan.stages[0].zero == 3
    assert dataclasses.replace(plan.stages[0]).shardings == plan.stages[0].shardings


def test_hybrid_priced_with_overlapped_communication(tmp_path):
    """Under `overlap_comm` (gradients reduced a layer at a time under the backward) a
    hybrid stage's across-node all-reduce is priced too, as exposed plus hidden time."""
    from hetpar.plan.costs import estimate_plan

    hybrid = _plan(tmp_path)
    overlapped = dataclasses.replace(hybrid, cost_inputs=dataclasses.replace(hybrid.cost_inputs, overlap_comm=True))
    stage = estimate_plan(overlapped).stages[0]
    problem = overlapped.cost_inputs
    costs = StageCosts(problem)
    cfg = decisions(overlapped).stages[0].config
    across = float(across_nodes_s(costs.kinds[cfg.kind], cfg, costs.tp_params(1)).sum())
    assert cfg.hybrid and across > 0
    assert stage.sync_s + stage.overlapped_s >= across * 0.999  # every layer's shard all-reduce, shown or hidden


def _all_reduces(text: str) -> list[tuple[list[str], str]]:
    """Each all-reduce of a compiled program: its result types and the mesh axes its
    replica groups span (as XLA prints a named mesh's groups, e.g. {'replica'})."""
    import re

    out = []
    for line in text.splitlines():
        found = re.search(r"= (.+?) all-reduce(?:-start)?\(.*replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
        if found:
            out.append((re.findall(r"\w+\[[\d,]*\]", found.group(1)), found.group(2)))
    return out


def test_hybrid_compiled_programs_cross_nodes_once_with_shards(tmp_path):
    """Two microbatches: every microbatch reduces its gradients within the node; only
    the last microbatch's fused update all-reduces across nodes, once, and only
    node-shards (the hidden 64x64 weight's gradient as 64x16), never a whole gradient."""
    workload = mlp.setup(batch_size=16, hidden=64, depth=2)
    par = hetpar.parallelize(workload.step, cluster=_cluster(tmp_path), num_stages=1, num_microbatches=2, mesh_shape=(8, 1),
                             sharding_option=ShardingOption(zero=3, zero_group=4))
    par(workload.state, workload.batch)
    step = par.compiled()
    programs = [p for p in (*step.programs, *step.fused.values()) if p is not None]
    across = [(type(p).__name__, types) for p in programs
              for types, axes in _all_reduces(p.lower().compile().as_text()) if axes == "'replica'"]
    assert any(type(p).__name__ == "Program" for p in programs)  # the first microbatch's, which stays in the node
    ((kind, shards),) = across  # one all-reduce across nodes per step
    assert kind == "FusedProgram"
    assert "f32[64,16]" in shards and "f32[64,64]" not in shards, shards


def test_hybrid_beside_model_axis_parity(tmp_path):
    """A 4 x 2 (data x model) stage on two nodes of four: ZeRO-3 over two data ranks
    of a node (each with its two model devices), two replicas across the nodes: the
    ILP's layouts over `data` x `model` (examples over both halves of `data`) beside
    ZeRO's over `zero`."""
    from models import gpt

    plan = run_parity(gpt.setup(batch_size=8), _cluster(tmp_path), steps=2, num_stages=1, num_microbatches=2, mesh_shape=(4, 2),
                      sharding_option=ShardingOption(zero=3, zero_group=2))
    (stage,) = plan.stages
    assert stage.mesh_shape == (4, 2) and stage.zero == 3 and stage.zero_group == 2
    specs = [spec for _, spec in stage.shardings]
    assert any("data" in spec and "model" in spec for spec in specs), "the model axis is not used"
    assert any("zero" in spec for spec in specs) and not any("data" in spec and "zero" in spec for spec in specs)


def test_replicas_inside_one_node_do_not_cross_nodes(tmp_path):
    """Groups of four on a node of eight: the replicas meet over the node's own link,
    and no byte is priced across nodes; on nodes of four, one group per node."""
    from solver.cost.stage_costs import StageConfig

    problem = _plan(tmp_path).cost_inputs
    (kind,) = problem.kinds
    for per_node, nodes in ((8, 1), (4, 2)):
        wide = dataclasses.replace(problem, kinds=(dataclasses.replace(kind, devices_per_node=per_node),))
        costs = StageCosts(wide)
        topology = across_topology(costs.kinds[kind.name], StageConfig(kind.name, 8, 1, 4))
        assert (topology.nodes, topology.size) == (nodes, 2)


def test_auto_group_takes_a_node_where_the_estimator_prices_it_faster(tmp_path):
    """zero_group="auto": on two nodes joined by a slow network, ZeRO-3 over the whole
    8-device axis gathers across nodes every microbatch; the estimator prices the
    node's group faster, so the pass takes it, and the plan is the cheaper one."""
    from hetpar.plan.costs import estimate_plan

    auto = _plan(tmp_path, zero_group="auto")
    whole = _plan(tmp_path, zero_group=0)
    assert auto.stages[0].zero_group == 4 and whole.stages[0].zero_group == 0
    assert estimate_plan(auto).step_s < estimate_plan(whole).step_s
    workload = _mlp()  # one node: nothing to gain, the whole axis stays
    single = hetpar.make_plan(workload.step, (workload.state, workload.batch), hetpar.Cluster.virtual({"A100": 8}),
                              num_stages=1, num_microbatches=1, mesh_shape=(8, 1),
                              sharding_option=ShardingOption(zero=3, zero_group="auto"))
    assert single.stages[0].zero_group == 0 and single.stages[0].zero == 3
    with pytest.raises(PlanError, match="ShardingOption.zero_group"):
        _plan(tmp_path, zero_group="node")
