"""In-network all-reduce (SHARP): a cluster file declares a fabric's switch reduction,
the collective registry prices it (`solver/collectives/in_network.py`), every pricer
sees it through the registry, `hetpar show` names it, and a launch switches the
collective library's algorithm on where the plan uses it."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

import hetpar
from hetpar.cli import main as cli_main
from hetpar.errors import ClusterError
from hetpar.plan.collectives import cluster_environment, plan_collectives, plan_environment
from hetpar.plan.file import load_plan
from hetpar.runtime.launcher import launch_local
from hetpar.shard.strategies import stage_problem
from hetpar.trace.traced_step import trace_step
from models import mlp
from parity import with_grads
from solver import collectives as c
from solver.collectives import LinkCost, SwitchReduction, Topology
from solver.collectives.in_network import switch_all_reduce
from solver.cost.collectives_used import collectives_used
from solver.cost.estimate import Decisions, StageDecision
from solver.cost.stage_costs import StageConfig
from solver.intra_op import solve_intra_op
from solver.planner import DeviceKind, LayerCost, Planner, Problem, plan

GIB = 2**30
NVLINK = LinkCost(300e9, 3e-6)
IB = LinkCost(25e9, 5e-6)
SHARP = SwitchReduction(levels=3, bandwidth=25e9, latency=0.6e-6)
IB_SHARP = LinkCost(25e9, 5e-6, reduction=SHARP)
ROOT = Path(__file__).resolve().parent.parent

CLUSTER = """\
name: sharp
groups:
  - name: a100
    device: A100
    nodes: 4
    devices_per_node: 2
    nics_per_node: 2
    inter_node:
      bandwidth: 25.0e+9
      latency: 5.0e-6
{reduction}"""
REDUCTION = "      in_network_reduction: {switch_levels: 2, latency: 0.6e-6, max_message_bytes: 1.0e+9}\n"


def _cluster_file(tmp_path: Path, reduction: str = REDUCTION, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(CLUSTER.format(reduction=reduction))
    return path


# --- the cluster file ---------------------------------------------------------------------

def test_a_cluster_file_declares_the_switches_reduction(tmp_path, capsys):
    assert cli_main(["validate", str(_cluster_file(tmp_path))]) == 0
    assert "a100: in-network reduction between its nodes: 2 switch level(s) of 0.6 us" in capsys.readouterr().out
    group = hetpar.Cluster.from_file(str(_cluster_file(tmp_path))).groups[0]
    assert group.inter_cost().reduction == SwitchReduction(2, 25e9, 0.6e-6, 1e9)  # bandwidth: the link's by default
    assert group.intra_cost().reduction is None
    plain = hetpar.Cluster.from_file(str(_cluster_file(tmp_path, reduction="", name="plain.yaml"))).groups[0]
    assert plain.inter_cost().reduction is None


@pytest.mark.parametrize("reduction, message", [
    ("{switch_levels: 0, latency: 1.0e-6}", r"line 11: inter_node.in_network_reduction switch_levels must be positive"),
    ("{switch_levels: 2.5, latency: 1.0e-6}", r"switch_levels must be an integer, got 2.5"),
    ("{latency: 1.0e-6}", r"in_network_reduction needs 'switch_levels:'"),
    ("{switch_levels: 2}", r"in_network_reduction needs 'latency:'"),
    ("{switch_levels: 2, latency: -1.0}", r"latency must not be negative"),
    ("{switch_levels: 2, latency: 1.0e-6, bandwidth: nan}", r"bandwidth must be a finite number"),
    ("{switch_levels: 2, latency: 1.0e-6, max_message_bytes: 0}", r"max_message_bytes must be positive"),
    ("{switch_levels: 2, latency: 1.0e-6, levels: 3}", r"unknown key 'levels'; expected one of: bandwidth, latency, "
                                                       r"max_message_bytes, switch_levels"),
    ("2", r"inter_node.in_network_reduction must be a mapping"),
])
def test_a_bad_reduction_is_one_line_naming_its_field(tmp_path, reduction, message):
    path = _cluster_file(tmp_path, reduction=f"      in_network_reduction: {reduction}\n")
    with pytest.raises(ClusterError, match=message):
        hetpar.Cluster.from_file(str(path))


def test_a_reduction_on_a_link_between_groups_is_refused_with_where_it_belongs(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text((ROOT / "tests" / "clusters" / "mp_two.yaml").read_text()
                    + "    in_network_reduction: {switch_levels: 2, latency: 1.0e-6}\n")
    with pytest.raises(ClusterError, match="put it under a group's inter_node:"):
        hetpar.Cluster.from_file(str(path))


# --- the price -----------------------------------------------------------------------------

def test_the_switches_price_one_trip_and_one_pass_of_the_message():
    flat = Topology(1, 16, IB_SHARP, IB_SHARP)
    trip = 5e-6 + 2 * 3 * 0.6e-6
    for m in (1e3, 1e6, 1e9):
        assert c.costs("all_reduce", flat, m)["in_network"] == pytest.approx(trip + m / 25e9)
    # A large message crosses each link once, where a ring crosses it twice: about half.
    ring = c.costs("all_reduce", flat, 1e9)["ring"]
    assert c.best("all_reduce", flat, 1e9)[0] == "in_network"
    assert 0.45 < c.costs("all_reduce", flat, 1e9)["in_network"] / ring < 0.55
    # The latency grows with the switch levels, not with the devices.
    wide = Topology(1, 1024, IB_SHARP, IB_SHARP)
    assert c.costs("all_reduce", wide, 1e3)["in_network"] == pytest.approx(c.costs("all_reduce", flat, 1e3)["in_network"])
    # Other collectives, and a fabric that cannot reduce, keep the other algorithms.
    assert "in_network" not in c.costs("all_gather", flat, 1e9)
    assert "in_network" not in c.costs("all_reduce", Topology(1, 16, IB, IB), 1e9)


def test_the_slower_of_the_link_and_the_switches_sets_the_rate_and_large_messages_go_in_pieces():
    slow = LinkCost(25e9, 5e-6, reduction=SwitchReduction(1, 10e9, 1e-6))
    assert switch_all_reduce(1e9, slow) == pytest.approx(5e-6 + 2e-6 + 1e9 / 10e9)
    limited = LinkCost(25e9, 5e-6, reduction=SwitchReduction(1, 25e9, 1e-6, max_message=1e6))
    trip = 7e-6
    # 1e9 bytes in pieces of 1e6: a thousand more trips (their count not rounded up: a straight line)
    assert switch_all_reduce(1e9, limited) == pytest.approx(trip + 1e9 / 25e9 + 1000 * trip)
    assert switch_all_reduce(1e9, limited) > switch_all_reduce(1e9, IB_SHARP)


def test_flows_sharing_a_nic_share_its_switch_port():
    shared = LinkCost(25e9, 5e-6, shared=25e9, reduction=SHARP)  # one NIC for a node's devices
    each = shared.per_flow(4)
    assert each.bandwidth == pytest.approx(25e9 / 4) and each.reduction.bandwidth == pytest.approx(25e9 / 4)
    assert shared.shared_by(2).reduction == SHARP


def test_across_nodes_the_node_reduce_scatters_then_its_devices_use_the_switches():
    """Nodes of 8 devices: reduce-scatter over NVLink, each device's eighth through the
    switches, all-gather; the hierarchical algorithm stays the hosts' and is unchanged."""
    sharp, plain = Topology(128, 8, NVLINK, IB_SHARP), Topology(128, 8, NVLINK, IB)
    m = float(GIB)
    inner = Topology(1, 8, NVLINK, NVLINK)
    expected = (c.best("reduce_scatter", inner, m)[1] + switch_all_reduce(m / 8, IB_SHARP)
                + c.best("all_gather", inner, m)[1])
    costs = c.costs("all_reduce", sharp, m)
    assert costs["in_network"] == pytest.approx(expected)
    assert costs["hierarchical"] == pytest.approx(c.costs("all_reduce", plain, m)["hierarchical"])
    assert c.best("all_reduce", sharp, m)[0] == "in_network" and costs["in_network"] < costs["hierarchical"]
    # The planner's vectorised price (the least of straight lines) agrees size by size.
    sizes = [1e2, 1e4, 1e6, 1e8, 4e9]
    assert list(c.fastest_times("all_reduce", sharp, sizes)) == pytest.approx([c.best("all_reduce", sharp, s)[1] for s in sizes])


# --- every pricer, through the registry -------------------------------------------------------

def _stage_problem(link: LinkCost):
    w = mlp.setup(batch_size=8, in_dim=512, hidden=2048, depth=1, out_dim=512)
    traced = trace_step(with_grads(w.loss_fn), (w.state, w.batch), 1, 1)
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    return stage_problem(traced.full, list(range(len(traced.full.ops))), batch_free, {"data": 1, "model": 4}, 1e12, link,
                         batch_axis=traced.analysis.batch_axis)


def test_the_sharding_ilp_prices_a_node_switch_that_reduces():
    """NVLink SHARP: a node's devices reduce in the NVSwitch; the ILP's partial sums
    over the model axis get cheaper."""
    nvls = LinkCost(300e9, 3e-6, reduction=SwitchReduction(1, 450e9, 0.5e-6))
    plain, switched = _stage_problem(NVLINK), _stage_problem(nvls)
    before, after = solve_intra_op(plain.problem), solve_intra_op(switched.problem)
    assert any(switched.choices[n][after.choice[n]].summed_over for n in range(len(switched.dots)))
    assert after.cost_s < before.cost_s


def _kind(inter: LinkCost) -> DeviceKind:
    return DeviceKind("a100", 32, 8, 1e14, 80 * GIB, 2e12, NVLINK, inter)


def _data_parallel(inter: LinkCost) -> Problem:
    layer = LayerCost(3e12, 1e12, 256 * 2**20, 2**20, 2**16)
    return Problem((layer,) * 4, (_kind(inter),), 256, microbatches=(1,), allow_replicas=False, max_tp=1, zero_stages=(0,))


def test_the_planner_and_the_estimator_price_the_switches():
    fixed = lambda p: Planner(p).fixed_split([StageConfig("a100", 32, 1)], 1, 256, "gpipe", ())  # noqa: E731
    plain, sharp = fixed(_data_parallel(IB)), fixed(_data_parallel(IB_SHARP))
    assert sharp.stages[0].sync_s < plain.stages[0].sync_s and sharp.step_s < plain.step_s
    assert plan(_data_parallel(IB_SHARP)).best.step_s < plan(_data_parallel(IB)).best.step_s
    decisions = Decisions((StageDecision("a100", 32, 1, 0, 4),), 1, "gpipe", (256,))
    (use,) = collectives_used(_data_parallel(IB_SHARP), decisions)
    assert (use.purpose, use.collective, use.devices, use.algorithm) == ("gradients", "all_reduce", 32, "in_network")
    assert use.nbytes == 4 * 256 * 2**20 and use.seconds == pytest.approx(sharp.stages[0].sync_s)
    (plain_use,) = collectives_used(_data_parallel(IB), decisions)
    assert plain_use.algorithm == "hierarchical"


def _solve(tmp_path: Path, cluster: Path, capsys) -> tuple[Path, str]:
    out = tmp_path / f"{cluster.stem}.json"
    assert cli_main(["solve", "mlp", "--cluster", str(cluster), "--batch-size", "16", "--microbatches", "1", "--layers", "4",
                     "--stages", "1", "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["show", str(out)]) == 0
    return out, capsys.readouterr().out


def test_show_names_the_algorithm_of_each_collective_and_a_launch_switches_it_on(tmp_path, capsys):
    sharp_plan, shown = _solve(tmp_path, _cluster_file(tmp_path), capsys)
    plain_plan, plain_shown = _solve(tmp_path, _cluster_file(tmp_path, reduction="", name="plain.yaml"), capsys)
    row = next(line for line in shown.splitlines() if "gradients" in line)
    assert "all-reduce" in row and "in_network" in row and "8" in row
    plain_row = next(line for line in plain_shown.splitlines() if "gradients" in line)
    assert "in_network" not in plain_row
    assert plain_row.split("│")[6].strip() in c.names()  # the algorithm column names a registered one
    # The timeline's trace names it on the gradient sync.
    trace = tmp_path / "trace.json"
    assert cli_main(["simulate", str(sharp_plan), "--trace", str(trace)]) == 0
    syncs = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "sync"]
    assert syncs and all(e["args"]["algorithm"] == "in_network" for e in syncs)
    # What a launch sets: NCCL's CollNet/SHARP switches for the plan that uses the switches only.
    sharp, plain = load_plan(sharp_plan), load_plan(plain_plan)
    assert {u.algorithm for u in plan_collectives(sharp)} == {"in_network"}
    assert plan_environment(sharp) == {"NCCL_COLLNET_ENABLE": "1", "SHARP_COLL_ENABLE_SAT": "1"}
    assert plan_environment(plain) == {}


def test_a_launch_without_a_plan_switches_on_what_the_fabric_offers(tmp_path):
    assert cluster_environment(hetpar.Cluster.from_file(str(_cluster_file(tmp_path))))["NCCL_COLLNET_ENABLE"] == "1"
    assert cluster_environment(hetpar.Cluster.from_file(str(_cluster_file(tmp_path, "", "plain.yaml")))) == {}


def test_the_launcher_sets_the_collective_library_switches_in_every_process(tmp_path):
    script = ("import json, os; json.dump({k: v for k, v in os.environ.items() if k.startswith(('NCCL_', 'SHARP_'))}, "
              f"open(os.path.join({str(tmp_path)!r}, os.environ['HETPAR_PROCESS_ID']), 'w'))")
    cluster = hetpar.Cluster.from_file(str(ROOT / "tests" / "clusters" / "mp_two.yaml"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SHARP_"))}
    env["SHARP_COLL_ENABLE_SAT"] = "0"  # set on purpose by the user: kept
    launch_local(cluster, [sys.executable, "-c", script], timeout_s=60, env=env,
                 collective_env={"NCCL_COLLNET_ENABLE": "1", "SHARP_COLL_ENABLE_SAT": "1"})
    seen = [json.loads((tmp_path / str(i)).read_text()) for i in range(2)]
    assert seen == [{"NCCL_COLLNET_ENABLE": "1", "SHARP_COLL_ENABLE_SAT": "0"}] * 2
    launch_local(cluster, [sys.executable, "-c", script], timeout_s=60, env=env)
    assert [json.loads((tmp_path / str(i)).read_text()) for i in range(2)] == [{"SHARP_COLL_ENABLE_SAT": "0"}] * 2


def test_the_algorithm_is_registered_once_in_one_module():
    algorithm = c.get("in_network")
    assert set(algorithm.times) == {"all_reduce"} and algorithm.lines is not None
    assert math.isinf(algorithm.time("all_reduce", Topology(4, 8, NVLINK, IB), 1e6))
