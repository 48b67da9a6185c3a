"""Extending hetpar is one module (or one catalog entry), and every pricer sees it.

Each recipe of the README's "How to extend" is exercised here on a toy: a collective
algorithm defined in one place, registered for the test only, then priced by
`solver.collectives`, the sharding ILP, the planner and a hand-made plan; a pipeline
schedule the same way; a device kind added by one catalog entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

import pytest

import hetpar
from hetpar.errors import ClusterError
from hetpar.pipeline import layers_of
from hetpar.shard.strategies import stage_problem
from hetpar.trace.traced_step import trace_step
from models import mlp
from parity import with_grads
from solver import collectives, schedules
from solver.collectives import Algorithm, LinkCost, Topology
from solver.intra_op import solve_intra_op
from solver.planner import DeviceKind, LayerCost, Planner, Problem, plan
from solver.cost.stage_costs import StageConfig
from solver.pipeline_sim import simulate
from solver.schedules import Schedule, StageTimes, Work

GIB = 2**30
LINK = LinkCost(25e9, 20e-6)


# --- a collective algorithm: one definition -----------------------------------------

def _in_network_all_reduce(n: int, nbytes: float, link: LinkCost) -> float:
    """The switch sums the message as it passes (SHARP-like): one latency and one
    trip of the message, whatever the group's size."""
    return link.latency + nbytes / link.bandwidth if n > 1 else 0.0


IN_NETWORK = Algorithm.flat("toy_in_network", {"all_reduce": _in_network_all_reduce})


def test_collectives_pick_the_new_algorithm_where_it_is_cheapest():
    flat8 = Topology(1, 8, LINK, LINK)
    before = collectives.best("all_reduce", flat8, 1e8)
    with collectives.registered(IN_NETWORK):
        assert collectives.best("all_reduce", flat8, 1e8) == ("toy_in_network", pytest.approx(LINK.time(1e8)))
        assert collectives.best("all_reduce", flat8, 1e8)[1] < before[1]
        # It is an all-reduce only: other collectives keep their algorithms.
        assert collectives.best("all_gather", flat8, 1e8)[0] != "toy_in_network"
        # The vectorised price the planner reads agrees with `best`, size by size.
        sizes = [1e3, 1e6, 1e9]
        assert list(collectives.fastest_times("all_reduce", flat8, sizes)) == pytest.approx(
            [collectives.best("all_reduce", flat8, m)[1] for m in sizes])
        # Across nodes the hierarchical algorithm runs its inter-node level with it too.
        nodes = Topology(4, 8, LinkCost(300e9, 3e-6), LINK)
        hierarchical = collectives.costs("all_reduce", nodes, 1e9)["hierarchical"]
    assert "toy_in_network" not in collectives.names()
    assert collectives.best("all_reduce", flat8, 1e8) == before  # nothing remembered from inside the block
    assert hierarchical < collectives.costs("all_reduce", nodes, 1e9)["hierarchical"]


def test_registering_a_taken_name_or_an_unknown_collective_is_refused():
    with pytest.raises(ValueError, match="'ring' is taken"):
        collectives.register(Algorithm.flat("ring", {"all_reduce": _in_network_all_reduce}))
    with pytest.raises(ValueError, match="gossip"):
        Algorithm.flat("gossip", {"gossip": _in_network_all_reduce})


def _tensor_parallel_stage():
    """A two-layer MLP wide against its batch: on a 4-wide model axis the ILP splits
    it Megatron's way and pays an all-reduce of partial sums."""
    w = mlp.setup(batch_size=8, in_dim=512, hidden=2048, depth=1, out_dim=512)
    traced = trace_step(with_grads(w.loss_fn), (w.state, w.batch), 1, 1)
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    return traced, batch_free


def _ilp_cost(traced, batch_free) -> tuple[float, bool]:  # noqa: ANN001
    problem = stage_problem(traced.full, list(range(len(traced.full.ops))), batch_free, {"data": 1, "model": 4}, 1e12, LINK,
                            batch_axis=traced.analysis.batch_axis)
    solution = solve_intra_op(problem.problem)
    sums = any(problem.choices[n][solution.choice[n]].summed_over for n in range(len(problem.dots)))
    return solution.cost_s, sums


def test_the_sharding_ilp_prices_the_new_algorithm():
    traced, batch_free = _tensor_parallel_stage()
    before, summed = _ilp_cost(traced, batch_free)
    with collectives.registered(IN_NETWORK):
        after, summed_after = _ilp_cost(traced, batch_free)
    assert summed and summed_after, "the stage should be split with partial sums to all-reduce"
    assert after < before
    assert _ilp_cost(traced, batch_free)[0] == pytest.approx(before)


def _data_parallel_problem() -> Problem:
    """Eight devices of one kind in one node, one microbatch: the best plan is data
    parallel (a pipeline would idle), and it all-reduces 1 GiB of gradients."""
    kind = DeviceKind("gpu", 8, 8, 1e14, 80 * GIB, 2e12, LINK, LINK)
    layer = LayerCost(3e12, 1e12, 256 * 2**20, 2**20, 2**16)
    return Problem((layer,) * 4, (kind,), 64, microbatches=(1,), allow_replicas=False, max_tp=1, zero_stages=(0,))


def test_the_planner_prices_the_new_algorithm():
    problem = _data_parallel_problem()
    fixed = lambda: Planner(problem).fixed_split([StageConfig("gpu", 8, 1)], 1, 64, schedules.DEFAULT, ())  # noqa: E731
    plain, best = fixed(), plan(problem).best
    with collectives.registered(IN_NETWORK):
        toy, toy_best = fixed(), plan(problem).best
    assert toy.stages[0].sync_s == pytest.approx(4 * 256 * 2**20 / LINK.bandwidth + LINK.latency)
    assert toy.stages[0].sync_s < plain.stages[0].sync_s and toy.step_s < plain.step_s
    assert best.stages[0].dp == 8 and toy_best.step_s < best.step_s


def test_a_hand_made_plan_prices_the_new_algorithm():
    w = mlp.setup(batch_size=8, depth=2)
    cluster = hetpar.Cluster.virtual({"A100": 8})

    def sync() -> float:
        made = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=1, num_stages=1, num_layers=2,
                                mesh_shape=(8, 1))
        return made.stages[0].sync_s

    before = sync()
    with collectives.registered(IN_NETWORK):
        after = sync()
    assert 0 < after < before


# --- a pipeline schedule: one module ----------------------------------------------------

class OneAtATime(Schedule):
    """Each microbatch goes forward through every stage and back before the next
    starts: one microbatch in flight, no overlap at all. Never faster than GPipe."""

    name = "one_at_a_time"

    def device_order(self, device: int, num_devices: int, num_microbatches: int, chunks: int = 1) -> list[Work]:
        return [w for k in range(num_microbatches) for w in (Work("F", 0, k), Work("B", 0, k))]

    def in_flight(self, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
        return 1

    def step_time(self, stages: Sequence[StageTimes], num_microbatches: int, chunks: int = 1) -> float:
        one = sum(s.forward_s + s.backward_s for s in stages) + 2 * sum(s.send_s for s in stages[:-1])
        return num_microbatches * one + stages[0].sync_s + stages[0].optimizer_s


def test_a_registered_schedule_is_planned_and_priced():
    """Eight layers of which a device holds two: a pipeline of four stages, where the
    schedule decides the step time."""
    layer = LayerCost(1e12, 1e12 / 3, 8 * GIB, 2**20, 2**10)
    kind = DeviceKind("gpu", 4, 4, 1e13, 80 * GIB, 1e12, LINK, LINK)
    problem = Problem((layer,) * 8, (kind,), 16, microbatches=(4,), schedules=("one_at_a_time",), allow_replicas=False,
                      max_tp=1, zero_stages=(0,))
    with pytest.raises(Exception, match="unknown schedule 'one_at_a_time'"):
        plan(problem)
    with schedules.registered(OneAtATime()):
        toy = plan(problem).best
        gpipe = plan(dataclasses.replace(problem, schedules=("gpipe",))).best
        times = [StageTimes(s.forward_s, s.backward_s, s.send_s, s.sync_s, s.optimizer_s) for s in toy.stages]
        simulated = simulate(times, 4, "one_at_a_time")
    assert "one_at_a_time" not in schedules.names()
    assert toy.schedule == "one_at_a_time" and len(toy.stages) > 1
    assert toy.step_s > gpipe.step_s  # no overlap: every stage waits for the others
    assert simulated.step_s == pytest.approx(OneAtATime().step_time(times, 4), rel=0.02)


# --- a device kind: one catalog entry ----------------------------------------------------

NPU = {
    "vendor": "Example", "platform": "gpu",
    "peak_flops": {"fp32": 40e12, "tf32": 200e12, "bf16": 400e12},
    "memory_bytes": 64 * GIB, "memory_bandwidth": 1.6e12,
    "intra_node_link": {"name": "Example link", "bandwidth": 200e9, "latency": 4e-6},
    "efficiency": 0.6,
    "source": "a made-up accelerator for tests/test_extending.py",
}


def test_a_device_kind_is_one_catalog_entry(tmp_path, monkeypatch):
    with pytest.raises(ClusterError, match="unknown device type 'NPU-X'"):
        hetpar.Cluster.virtual({"NPU-X": 4, "V100": 4})
    entries = tmp_path / "devices.json"
    entries.write_text(json.dumps({"NPU-X": NPU}))
    monkeypatch.setenv("HETPAR_DEVICES", str(entries))
    cluster = hetpar.Cluster.virtual({"NPU-X": 4, "V100": 4})
    w = mlp.setup(batch_size=8, depth=4)
    made = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=2)
    kinds = {s.device_type for s in made.stages}
    assert "NPU-X" in kinds, made.stages
    npu = next(s for s in made.stages if s.device_type == "NPU-X")
    assert npu.memory_capacity and npu.memory_capacity <= NPU["memory_bytes"]
    assert math.isfinite(made.predicted_step_time_s) and made.predicted_step_time_s > 0


def test_a_malformed_catalog_entry_is_named(tmp_path, monkeypatch):
    entries = tmp_path / "devices.json"
    entries.write_text(json.dumps({"NPU-Y": {k: v for k, v in NPU.items() if k != "efficiency"}}))
    monkeypatch.setenv("HETPAR_DEVICES", str(entries))
    with pytest.raises(ClusterError, match="device 'NPU-Y' lacks efficiency"):
        hetpar.Cluster.virtual({"NPU-Y": 4})
