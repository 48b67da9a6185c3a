"""Devices of two vendors in one job: no device link joins them, so values between
their stages go through host memory (runtime/communicator.HostStagedPath), in
chunks, while moves within a vendor stay device to device. On CPU the vendors are
declared (A100 and H100 are NVIDIA's, MI250X AMD's); the parity is with jax.jit."""

from __future__ import annotations

import textwrap

import jax
import pytest

import hetpar
from hetpar.runtime import communicator, executor
from models import gpt
from parity import assert_close, with_grads

CONFIG = gpt.GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=16, vocab_size=64)


@pytest.fixture(scope="module")
def workload():
    w = gpt.setup(batch_size=8, config=CONFIG)
    step = with_grads(w.loss_fn)
    return w, step, jax.jit(step)(w.state, w.batch)


def _ids(devices) -> frozenset[int]:
    return frozenset(d.id for d in devices)


@pytest.fixture
def moves(monkeypatch):
    """Every move the runtime makes, as (path, source device ids, destination device
    ids); the host-staged path with chunks small enough that most values cross in
    several."""
    seen: list[tuple[str, frozenset, frozenset]] = []

    def spy(name, path):
        original = path.to_mesh

        def to_mesh(x, sharding):
            if hasattr(x, "sharding"):
                seen.append((name, _ids(x.sharding.device_set), _ids(sharding.device_set)))
            return original(x, sharding)

        path.to_mesh = to_mesh
        return path

    monkeypatch.setattr(executor, "_HOST", spy("host", communicator.HostStagedPath(chunk_bytes=512)))
    monkeypatch.setattr(executor, "_PATH", spy("device", communicator.DevicePath()))
    return seen


def _vendors(vendors: dict[int, str], ids: frozenset) -> set[str]:
    return {vendors[i] for i in ids if i in vendors}


@pytest.mark.parametrize("counts", [{"A100": 4, "MI250X": 4}, {"A100": 2, "H100": 2, "MI250X": 4}],
                         ids=["nvidia-amd", "nvidia-nvidia-amd"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_of_two_vendors_match_jit(workload, moves, counts, schedule):
    w, step, reference = workload
    parallel = hetpar.parallelize(
        step, cluster=hetpar.Cluster.virtual(counts), num_microbatches=2, schedule=schedule,
        stage_option=hetpar.StageOption(mode="uniform", num_stages=len(counts), num_layers=4),
    )
    out = parallel(w.state, w.batch)
    for got, want, what in zip(out, reference, ("state", "loss", "grads")):
        assert_close(got, want, f"{counts} {schedule}: {what}")
    vendors = parallel.compiled().vendors
    assert sorted(set(vendors.values())) == ["AMD", "NVIDIA"]
    crossing = [(path, _vendors(vendors, a) | _vendors(vendors, b)) for path, a, b in moves]
    assert any(path == "host" for path, _ in crossing), "values between the vendors' stages went through the host"
    assert all(len(ends) == 2 for path, ends in crossing if path == "host"), "only moves between vendors use the host"
    assert not any(len(ends) == 2 for path, ends in crossing if path == "device"), "no device copy joins two vendors"
    if len(counts) == 3:  # the A100 -> H100 activations and gradients stay device to device
        assert any(path == "device" and ends == {"NVIDIA"} for path, ends in crossing)


def test_replicas_of_two_vendors_merge_through_the_host(workload, moves):
    w, step, reference = workload
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual({"A100": 4, "MI250X": 4}), num_microbatches=2,
                                  stage_option=hetpar.StageOption(mode="uniform", num_stages=1, num_replicas=2, num_layers=4))
    out = parallel(w.state, w.batch)
    for got, want, what in zip(out, reference, ("state", "loss", "grads")):
        assert_close(got, want, f"two vendors' replicas: {what}")
    assert any(path == "host" for path, _, _ in moves)


def test_one_vendor_moves_nothing_through_the_host(workload, moves):
    w, step, _ = workload
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual({"A100": 4, "H100": 4}), num_microbatches=2,
                                  stage_option=hetpar.StageOption(mode="uniform", num_stages=2, num_layers=4))
    parallel(w.state, w.batch)
    assert parallel.compiled().vendors == {} and not any(path == "host" for path, _, _ in moves)


def test_a_direct_link_between_two_vendors_is_refused(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent("""
        groups:
          - {name: a, device: A100, nodes: 1, devices_per_node: 8}
          - {name: m, device: MI250X, nodes: 1, devices_per_node: 8}
        links:
          - {between: [a, m], bandwidth: 50.0e+9, latency: 1.0e-6, direct: true}
    """))
    with pytest.raises(hetpar.ClusterError, match="no device link joins two vendors"):
        hetpar.Cluster.from_file(str(path))


def test_two_vendors_are_priced_through_both_hosts():
    a100 = hetpar.DeviceGroup("A100", (0,), name="a")
    mi = hetpar.DeviceGroup("MI250X", (1,), name="m")
    h100 = hetpar.DeviceGroup("H100", (2,), name="h")
    from hetpar.cluster.catalog import Link
    from hetpar.cluster.groups import HOST_LINK, GroupLink

    nvlink = Link("nvlink", 400e9, 1e-6)
    links = {frozenset(("a", "m")): GroupLink(nvlink, direct=True), frozenset(("a", "h")): GroupLink(nvlink, direct=True),
             frozenset(("m", "h")): GroupLink(nvlink, direct=True)}
    cluster = hetpar.Cluster((a100, mi, h100), links)
    assert cluster.link_between(a100, h100).bandwidth == 400e9  # one vendor: the direct link
    across = cluster.link_between(a100, mi)
    assert across.bandwidth == HOST_LINK.bandwidth and across.latency > nvlink.latency


def test_two_vendors_on_two_processes_are_refused_before_a_step():
    from types import SimpleNamespace as Device

    devices = [Device(id=0, process_index=0), Device(id=1, process_index=1), Device(id=2, process_index=1)]
    communicator.check_host_staged({0: "NVIDIA", 1: "NVIDIA"}, devices)  # one vendor: device to device
    communicator.check_host_staged({1: "NVIDIA", 2: "AMD"}, devices)  # two vendors within one process
    with pytest.raises(hetpar.HetparError, match="two vendors' devices on different processes"):
        communicator.check_host_staged({0: "NVIDIA", 2: "AMD"}, devices)
