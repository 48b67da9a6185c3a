"""Cluster files: a good one loads; each kind of mistake is refused naming its line."""

import textwrap

import pytest

import hetpar
from hetpar.cluster.catalog import device_type

GOOD = """\
name: demo
groups:
  - name: fast
    device: H100
    nodes: 2
    devices_per_node: 8
    inter_node: {bandwidth: 50e9, latency: 5e-6}
  - name: slow
    device: V100
    nodes: 1
    devices_per_node: 4
links:
  - between: [fast, slow]
    bandwidth: 12.5e9
    latency: 1e-5
"""


def _load(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return hetpar.Cluster.from_file(str(path))


def test_good_file_loads(tmp_path):
    cluster = _load(tmp_path, GOOD)
    fast, slow = cluster.groups
    assert (fast.type_name, fast.nodes, fast.devices_per_node, fast.size) == ("H100", 2, 8, 16)
    assert fast.inter_link.bandwidth == 50e9
    assert slow.intra_link == device_type("V100").intra_node_link
    path = cluster.link_between(fast, slow)
    assert path.bandwidth == 12.5e9  # the slowest hop of device -> host -> network -> host -> device
    assert path.latency > 1e-5


def test_example_cluster_files_load():
    import pathlib

    for path in pathlib.Path(__file__).parent.parent.glob("examples/clusters/*.yaml"):
        assert hetpar.Cluster.from_file(str(path)).num_devices > 0


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("device: V100", "device: V200", r"line 9: unknown device type 'V200'; known types: .*V100"),
        ("nodes: 1", "nodes: 0", r"line 10: nodes must be positive, got 0"),
        ("devices_per_node: 4", "devices_per_node: -4", r"line 11: devices_per_node must be positive, got -4"),
        ("devices_per_node: 4", "devices_per_node: four", r"line 11: devices_per_node must be an integer"),
        ("    bandwidth: 12.5e9\n", "    bandwidth: -1\n", r"line 14: link bandwidth must be positive"),
        ("between: [fast, slow]", "between: [fast, medium]", r"line 13: no group is named 'medium'"),
        ("    inter_node: {bandwidth: 50e9, latency: 5e-6}\n", "", r"line 3: a group of 2 nodes needs 'inter_node:'"),
        ("    device: H100\n", "", r"line 3: the group needs 'device:'"),
        ("    nodes: 2\n", "    nodes: 2\n    gpus: 8\n", r"line 6: unknown key 'gpus'"),
        ("name: slow", "name: fast", r"two groups are named 'fast'"),
    ],
)
def test_mistakes_name_their_line(tmp_path, old, new, message):
    assert old in GOOD
    with pytest.raises(hetpar.ClusterError, match=message):
        _load(tmp_path, GOOD.replace(old, new, 1))


def test_missing_link_between_groups_that_must_talk(tmp_path):
    text = GOOD[: GOOD.index("links:")]
    with pytest.raises(hetpar.ClusterError, match=r"no link between groups 'fast' and 'slow'.*between: \[fast, slow\]"):
        _load(tmp_path, text)


def test_broken_yaml_and_empty_file(tmp_path):
    with pytest.raises(hetpar.ClusterError, match="line 3: not valid YAML"):
        _load(tmp_path, "groups:\n  - device: A100\n   nodes: [1\n")
    with pytest.raises(hetpar.ClusterError, match="empty"):
        _load(tmp_path, "")
    with pytest.raises(hetpar.ClusterError, match="cannot read cluster file"):
        hetpar.Cluster.from_file(str(tmp_path / "nope.yaml"))
