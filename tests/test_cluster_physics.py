"""Communication and memory as clusters have them: a node's devices share its NICs,
devices without peer-to-peer stage through host memory, blocking transports hold
their senders, and JAX's client leaves a plan only part of each device's memory.
Each is priced by the one estimator (and the collectives the sharding ILP reads)."""

import math
import textwrap
from dataclasses import replace

import numpy as np
import pytest

import hetpar
from hetpar.cluster.memory import client_memory
from hetpar.errors import ClusterError
from hetpar.plan.auto import device_kinds, group_links
from hetpar.plan.costs import estimate_plan, fit_problems
from models import mlp
from solver import collectives as c
from solver.cost.estimate import Decisions, StageDecision, estimate
from solver.cost.problem import LayerCost, PlanningError, Problem
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.cost.topologies import tp_allreduce_s
from solver.planner import plan as search

GIB = 2**30
NIC = 12.5e9  # one 100 Gb/s NIC


def _cluster(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return hetpar.Cluster.from_file(str(path)).numbered()


def _two_nodes(tmp_path, nics: int, extra: str = ""):
    # NVLink-fast inside the node and no latency, so the across-node bandwidth is all that differs.
    return _cluster(tmp_path, f"""\
        groups:
          - name: g
            device: A100
            nodes: 2
            devices_per_node: 8
            intra_node: {{bandwidth: 1.0e+15, latency: 0}}
            inter_node: {{bandwidth: {NIC}, latency: 0}}
            nics_per_node: {nics}
        {extra}""")


LAYERS = tuple(LayerCost(flops=6e9, forward_flops=2e9, param_bytes=GIB, saved_bytes=1e6, input_bytes=1e6) for _ in range(4))


def test_a_nodes_devices_reducing_through_one_nic_pay_eight_shares(tmp_path):
    """16 devices on 2 nodes sum a gradient of G bytes: each device carries G/8
    across nodes. Through one shared NIC that takes at least 8x as long as one
    device's share alone on it; with a NIC per device (DGX-style), one share's time."""
    grads = float(sum(layer.param_bytes for layer in LAYERS))
    one_share = c.allreduce_ring(2, grads / 8, c.LinkCost(NIC, 0.0))  # one device's share, the NIC to itself
    syncs = {}
    for nics in (1, 8):
        cluster = _two_nodes(tmp_path, nics)
        problem = Problem(LAYERS, device_kinds(cluster), batch_size=16, links=group_links(cluster))
        cost = estimate(problem, Decisions((StageDecision("g", 16, 1, 0, 4),), 1, "1f1b", (16,)))
        syncs[nics] = cost.stages[0].sync_s
    assert syncs[1] >= 8 * one_share * (1 - 1e-9)
    assert syncs[8] == pytest.approx(one_share, rel=1e-3)  # (the in-node levels cost next to nothing)
    # The planner's tables read the same price (one function).
    table = StageCosts(Problem(LAYERS, device_kinds(_two_nodes(tmp_path, 1)), batch_size=16))
    assert table.variant(StageConfig("g", 16, 1), 1, 1, True, 0, "").sync[0, 4] == pytest.approx(syncs[1])


def test_a_shared_nic_divides_among_the_flows_that_cross_it():
    shared = c.LinkCost(NIC, 1e-6, shared=2 * NIC)  # two NICs
    assert shared.per_flow(1).bandwidth == NIC and shared.per_flow(2).bandwidth == NIC
    assert shared.per_flow(8).bandwidth == NIC / 4
    # a ring over the nodes sends one flow per node: the whole NIC; recursive halving, every device at once
    topo = c.Topology(2, 8, c.LinkCost(1e15, 0.0), c.LinkCost(NIC, 0.0, shared=NIC))
    assert c.get("ring").time("all_reduce", topo, 1e9) == pytest.approx(c.allreduce_ring(16, 1e9, c.LinkCost(NIC, 0.0)))
    assert c.get("recursive_halving_doubling").time("all_reduce", topo, 1e9) == pytest.approx(
        c.allreduce_recursive_doubling(16, 1e9, c.LinkCost(NIC / 8, 0.0)))


def test_pipeline_sends_of_a_nodes_slices_share_its_nic(tmp_path):
    cluster = _two_nodes(tmp_path, 1)
    costs = StageCosts(Problem(LAYERS, device_kinds(cluster), batch_size=16))
    one = costs.sends(StageConfig("g", 1, 1), StageConfig("g", 1, 1), 8)[1]
    eight = costs.sends(StageConfig("g", 8, 1), StageConfig("g", 8, 1), 8)[1]
    assert eight == pytest.approx(one)  # 8 slices each send an eighth, all through the one NIC


def test_a_link_without_peer_to_peer_is_priced_at_the_host_staged_rate(tmp_path):
    """8 GeForce-like cards without peer-to-peer: every copy crosses host memory
    twice, and the node's 8 concurrent copies share it. The all-reduce the ILP and
    the estimator price runs at host_bandwidth / 2 / 8 per link, not PCIe's 32 GB/s."""
    host = 25e9
    text = """\
        groups:
          - name: g
            device: RTX4090
            nodes: 1
            devices_per_node: 8
            peer_to_peer: {p2p}
            host_bandwidth: {host}
        """
    direct = _cluster(tmp_path, text.format(p2p="true", host=host)).groups[0]
    staged = _cluster(tmp_path, text.format(p2p="false", host=host)).groups[0]
    link = staged.intra_cost()  # what the pipeline hands the sharding ILP, and the estimator's kinds
    flat = c.Topology(1, 8, link, link)
    assert flat.flat_link().bandwidth == pytest.approx(host / 2 / 8)
    nbytes = 256e6
    expected = c.best("all_reduce", c.Topology(1, 8, *[c.LinkCost(host / 16, link.latency)] * 2), nbytes)[1]
    assert c.best("all_reduce", flat, nbytes)[1] == pytest.approx(expected)
    fast = direct.intra_cost()
    assert c.best("all_reduce", c.Topology(1, 8, fast, fast), nbytes)[1] * 10 < expected
    # The estimator's tensor-parallel all-reduce reads the same link.
    tp_price = {}
    for name, group in (("staged", staged), ("direct", direct)):
        costs = StageCosts(Problem(LAYERS, device_kinds(hetpar.Cluster((group,)).numbered()), batch_size=8))
        tp_price[name] = tp_allreduce_s(costs.kinds["g"], 8, np.array([nbytes]), np.array([1.0]))[0]
    assert tp_price["staged"] == pytest.approx(expected)
    assert tp_price["direct"] * 10 < expected


def test_a_blocking_transport_holds_the_sender(tmp_path):
    """Sends over a link with `overlap: false` are added to the stages' compute:
    the step is slower than with the same link overlapping, by at least the sends."""
    text = """\
        groups:
          - name: a
            device: A100
            nodes: 1
            devices_per_node: 2
          - name: b
            device: A100
            nodes: 1
            devices_per_node: 2
        links:
          - between: [a, b]
            bandwidth: 1.0e+9
            latency: 1.0e-5
            overlap: {overlap}
        """
    layers = tuple(LayerCost(flops=6e10, forward_flops=2e10, param_bytes=1e6, saved_bytes=1e6, input_bytes=5e6)
                   for _ in range(4))
    d = Decisions((StageDecision("a", 2, 1, 0, 2), StageDecision("b", 2, 1, 2, 4)), 4, "1f1b", (16,))
    priced = {}
    for overlap in ("true", "false"):
        cluster = _cluster(tmp_path, text.format(overlap=overlap))
        priced[overlap] = estimate(Problem(layers, device_kinds(cluster), batch_size=16, links=group_links(cluster)), d)
    send = priced["true"].stages[0].send_s
    assert send > 0 and priced["false"].stages[0].send_s == 0
    assert priced["false"].stages[0].forward_s == pytest.approx(priced["true"].stages[0].forward_s + send)
    assert priced["false"].stages[1].backward_s == pytest.approx(priced["true"].stages[1].backward_s + send)
    assert priced["false"].step_s > priced["true"].step_s


# --- memory as JAX leaves it ----------------------------------------------------------------

def test_the_client_memory_share_comes_from_the_environment():
    assert client_memory("gpu", {}).fraction == 0.75
    assert client_memory("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}).fraction == 0.9
    assert client_memory("gpu", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}).fraction == 0.75  # grows into the same cap
    assert client_memory("gpu", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}).fraction == 1.0
    assert client_memory("cpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}).fraction == 1.0  # no pool on CPU
    with pytest.raises(ClusterError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='lots' is not a number"):
        client_memory("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})
    with pytest.raises(ClusterError, match=r"must be a fraction in \(0, 1\]"):
        client_memory("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"})


def test_cpu_devices_keep_their_whole_memory():
    (kind,) = device_kinds(hetpar.Cluster.virtual({"cpu": 2}))
    assert kind.usable_bytes == kind.memory_bytes


def _one_v100(tmp_path):
    return _cluster(tmp_path, """\
        groups:
          - name: v100
            device: V100
            nodes: 1
            devices_per_node: 1
        """)


def test_a_plan_that_fits_only_above_the_clients_share_is_refused(tmp_path, monkeypatch):
    """A 32 GiB V100 under JAX's default share keeps 0.75 x 32 - 1 = 23 GiB for a
    plan. A model whose state needs about 26 GiB fits the device but not that: the
    planner refuses it naming the numbers and the setting; at a fraction of 0.9 it plans."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    layers = tuple(LayerCost(flops=6e9, forward_flops=2e9, param_bytes=int(1.6 * GIB), saved_bytes=1e6, input_bytes=1e6)
                   for _ in range(4))  # 6.4 GiB of f32 parameters: 25.6 GiB with gradients and Adam's state
    problem = lambda: Problem(layers, device_kinds(_one_v100(tmp_path)), batch_size=4)  # noqa: E731
    (kind,) = problem().kinds
    assert kind.usable_bytes == pytest.approx(0.75 * 32 * GIB - GIB)
    with pytest.raises(PlanningError) as e:
        search(problem())
    message = str(e.value)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75" in message and "23.0 GiB" in message and "32.0 GiB" in message
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert search(problem()).best.stages  # 0.9 x 32 - 1 = 27.8 GiB: it fits


def test_a_hand_made_plan_past_the_share_names_the_fraction_that_would_fit(monkeypatch):
    """The pre-flight check (`fit_problems`, what `parallelize` and `hetpar run`
    refuse a plan with) says what the client takes and the fraction that would fit."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    w = mlp.setup(batch_size=8, depth=4)
    plan = hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual({"A100": 2}), num_microbatches=2)
    need = max(s.group_memory_bytes for s in estimate_plan(plan).stages)
    # A device this plan fills at 80% of its memory: it fits the whole device, not the client's 75%.
    small = tuple(replace(k, memory_bytes=int(need / 0.8 / (1 - plan.cost_inputs.memory_reserve)), process_reserve_bytes=0.0)
                  for k in plan.cost_inputs.kinds)
    tight = replace(plan, cost_inputs=replace(plan.cost_inputs, kinds=small))
    problems = fit_problems(tight, estimate_plan(tight))
    assert problems, "the plan should overflow the client's share"
    text = " ".join(problems)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75" in text
    wanted = float(text.split("it would fit at XLA_PYTHON_CLIENT_MEM_FRACTION=")[1].split()[0])
    assert 0.8 <= wanted <= 0.82 and not math.isnan(wanted)


def test_measured_links_read_back_as_a_cluster_files_group(tmp_path):
    # `hetpar profile --links`: the fields it prints, pasted under a group, are what
    # the cluster file then prices with.
    import jax
    import yaml

    from hetpar.predict.links import fit_line, measure_links

    line = fit_line([1e6, 2e6, 4e6], [2e-6 + 1e6 / 5e9, 2e-6 + 2e6 / 5e9, 2e-6 + 4e6 / 5e9])
    assert line.bandwidth == pytest.approx(5e9) and line.latency == pytest.approx(2e-6)
    links = measure_links(jax.devices()[:2], "cpu", sizes=(1 << 16, 1 << 18, 1 << 20), repeats=2)
    assert links.intra_node.bandwidth > 0 and links.host.bandwidth > 0 and links.peer_to_peer
    group = yaml.safe_load(links.as_yaml())
    path = tmp_path / "measured.yaml"
    path.write_text("groups:\n  - name: here\n    device: cpu\n    nodes: 1\n    devices_per_node: 2\n"
                    + textwrap.indent(links.as_yaml(), "    ") + "\n")
    cluster = hetpar.Cluster.from_file(str(path))
    assert cluster.groups[0].intra_link.bandwidth == pytest.approx(group["intra_node"]["bandwidth"])
    assert cluster.groups[0].host_bandwidth == pytest.approx(group["host_bandwidth"])
