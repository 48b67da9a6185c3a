"""`hetpar launch --elastic`: lose a process mid-run, re-plan for the nodes left,
resume from the latest checkpoint, with the losses of `jax.jit` from there. Real
processes (four, then three), killed with SIGKILL; the benchmark's own driver."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_lost_node_leaves_the_cluster_file_and_its_links(tmp_path):
    from hetpar.runtime.elastic import without_node
    from hetpar.runtime.launcher import ProcessSpec

    four = ROOT / "examples" / "clusters" / "four_processes.yaml"
    out = tmp_path / "three.yaml"
    assert without_node(four, ProcessSpec(3, "v100-1", "V100", 0, 2), out)
    doc = yaml.safe_load(out.read_text())
    assert [g["name"] for g in doc["groups"]] == ["a100-0", "a100-1", "v100-0"]
    assert all("v100-1" not in link["between"] for link in doc["links"])
    import hetpar

    assert hetpar.Cluster.from_file(str(out)).num_devices == 6
    one = tmp_path / "one.yaml"
    one.write_text("groups:\n  - {name: a, device: A100, nodes: 1, devices_per_node: 2}\n")
    assert not without_node(one, ProcessSpec(0, "a", "A100", 0, 2), tmp_path / "none.yaml")


def test_training_survives_a_lost_process():
    import elastic

    run = elastic.run(steps=3, every=1, kill_after=0, timeout_s=600)
    assert run.processes_after == 3, run.output[-3000:]
    assert "starting again without that node" in run.output
    assert run.lost_steps <= 1  # at most the checkpoint interval
    expected = elastic.reference_losses(run, 3)
    assert run.losses_after and elastic.losses_match(run.losses_after, expected), (run.losses_after, expected)
