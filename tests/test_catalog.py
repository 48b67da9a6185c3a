"""The device catalog: rates that match each device's hardware, a source for every
figure, per-group overrides in a cluster file that change a plan's price, and the
README's table of cluster-file fields generated from the schema."""

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import hetpar
from hetpar.cluster.catalog import catalog, device_type
from hetpar.cluster.cluster import _type_of
from hetpar.cluster.schema import fields_table
from hetpar.errors import ClusterError
from hetpar.plan.auto import device_kinds, group_links
from solver.cost.estimate import Decisions, StageDecision, estimate
from solver.cost.problem import LayerCost, Problem

GIB = 2**30
README = Path(__file__).resolve().parents[1] / "README.md"


def test_volta_computes_bf16_at_its_f32_rate():
    """Volta has no bf16 (or TF32) units: XLA runs bf16 and f32 matmuls there at the
    FP32 rate; fp16 gets the tensor cores."""
    for name in ("V100", "V100-16GB"):
        v100 = device_type(name)
        assert v100.matmul_flops("bfloat16") == v100.matmul_flops("float32") == v100.flops("fp32") == 15.7e12
        assert v100.matmul_flops("float16") == 125e12
        assert "fp8" not in v100.peak_flops
    a100 = device_type("A100")
    assert a100.matmul_flops("float32") == 156e12 and a100.matmul_flops("bfloat16") == 312e12  # TF32, JAX's default


def test_v100_bf16_plan_is_priced_at_the_f32_rate(tmp_path):
    """A bf16 plan on V100s is priced at the FP32 rate: exactly as slow as the same
    plan in f32 (both at 15.7 TF), and 125/15.7 times slower than the fp16
    tensor-core rate would make it."""
    cluster = hetpar.Cluster.virtual({"V100": 2}).numbered()
    times = {}
    for dtype in ("bfloat16", "float32", "float16"):
        problem = Problem(LAYERS, device_kinds(cluster, dtype, layer_overhead_s=0.0), batch_size=8)
        times[dtype] = estimate(problem, ONE_STAGE("V100", 2)).stages[0].forward_s
    assert times["bfloat16"] == pytest.approx(times["float32"])
    assert times["bfloat16"] == pytest.approx(times["float16"] * 125 / 15.7, rel=1e-6)


def test_fp8_only_where_the_hardware_has_it():
    for name in ("H100", "H200", "B200", "L4", "L40S", "MI300X"):
        assert device_type(name).flops("fp8") > device_type(name).flops("bf16"), name
    for name in ("A100", "A10", "V100", "MI250X"):
        assert "fp8" not in device_type(name).peak_flops, name
        assert device_type(name).matmul_flops("float8_e4m3fn") == device_type(name).matmul_flops("bfloat16")


def test_new_kinds_with_memory_bandwidths_and_sources():
    expected_gib = {"V100-16GB": 16, "A10": 24, "L4": 24, "L40S": 48, "H200": 141, "B200": 180, "MI250X": 64, "MI300X": 192}
    for name, gib in expected_gib.items():
        d = device_type(name)
        assert d.memory_bytes == gib * GIB, name
        assert d.memory_bandwidth > 0 and d.intra_node_link.bandwidth > 0
    for d in catalog().values():
        sources = dict(d.sources)
        assert d.source, d.name
        if d.platform != "cpu":
            for figure in ("peak_flops", "memory", "intra_node_link", "process_reserve_bytes"):
                assert sources.get(figure), (d.name, figure)
            assert 0.5 * GIB <= d.process_reserve_bytes <= 2 * GIB, d.name
        else:
            assert d.process_reserve_bytes == 0  # CPU devices keep their whole memory


def test_jax_device_kinds_map_to_memory_sized_entries():
    gpu = lambda kind: SimpleNamespace(device_kind=kind, platform="gpu")  # noqa: E731
    assert _type_of(gpu("Tesla V100-SXM2-16GB")) == "V100-16GB"
    assert _type_of(gpu("Tesla V100-SXM2-32GB")) == "V100"
    assert _type_of(gpu("NVIDIA A100-SXM4-40GB")) == "A100-40GB"
    assert _type_of(gpu("NVIDIA A10")) == "A10"
    assert _type_of(gpu("NVIDIA L40S")) == "L40S"


# --- per-group overrides ---------------------------------------------------------------

LAYERS = tuple(LayerCost(flops=6e12, forward_flops=2e12, param_bytes=2 * GIB, saved_bytes=1e8, input_bytes=1e7)
               for _ in range(4))


def ONE_STAGE(kind: str, dp: int) -> Decisions:  # noqa: N802
    return Decisions((StageDecision(kind, dp, 1, 0, len(LAYERS)),), num_microbatches=2, schedule="1f1b", replica_batch=(8,))


def _cluster(tmp_path, extra: str = ""):
    text = textwrap.dedent("""\
        groups:
          - name: v100
            device: V100
            nodes: 2
            devices_per_node: 8
            inter_node: {bandwidth: 12.5e9, latency: 5e-6}
        """) + textwrap.indent(textwrap.dedent(extra), "    ")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return hetpar.Cluster.from_file(str(path)).numbered()


def _price(cluster):
    problem = Problem(LAYERS, device_kinds(cluster, "float32"), batch_size=8, links=group_links(cluster))
    return estimate(problem, ONE_STAGE("v100", 16))


def test_group_overrides_change_the_plans_price(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    base = _price(_cluster(tmp_path))
    faster = _price(_cluster(tmp_path, "flops: {tf32: 31.4e12}\n"))
    assert faster.stages[0].forward_s == pytest.approx(base.stages[0].forward_s / 2, rel=0.05)
    assert faster.step_s < base.step_s
    small = _price(_cluster(tmp_path, "memory_gib: 16\n"))
    assert small.stages[0].capacity < base.stages[0].capacity
    assert small.stages[0].capacity == int(16 * GIB * 0.75 - GIB)  # JAX's default share less the V100's reserve
    slow_memory = _price(_cluster(tmp_path, "memory_bandwidth: 0.45e12\n"))
    assert slow_memory.stages[0].optimizer_s == pytest.approx(2 * base.stages[0].optimizer_s)
    efficient = _price(_cluster(tmp_path, "efficiency: 0.325\n"))  # half the catalog's 0.65
    assert efficient.stages[0].forward_s > 1.9 * base.stages[0].forward_s
    nics = _price(_cluster(tmp_path, "nics_per_node: 8\n"))  # a NIC per device: the gradient sync is cheaper
    assert nics.stages[0].sync_s < base.stages[0].sync_s


def test_memory_overrides_set_what_a_plan_may_fill(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    (kind,) = device_kinds(_cluster(tmp_path, "memory_gib: 16\nprocess_reserve_gib: 0.5\nmemory_fraction: 0.9\n"))
    assert kind.memory_bytes == 16 * GIB and kind.usable_bytes == pytest.approx(16 * GIB * 0.9 - 0.5 * GIB)


@pytest.mark.parametrize("line, message", [
    ("memory_gib: -1\n", "memory_gib must be positive"),
    ("memory_fraction: 1.5\n", "memory_fraction must be at most 1"),
    ("flops: {bf17: 1e12}\n", "unknown key 'bf17'"),
    ("flops: {bf16: fast}\n", "flops bf16 must be a number"),
    ("nics_per_node: 0\n", "nics_per_node must be positive"),
    ("peer_to_peer: maybe\n", "peer_to_peer"),
])
def test_bad_overrides_are_named_with_their_line(tmp_path, line, message):
    with pytest.raises(ClusterError, match=re.escape(message)) as e:
        _cluster(tmp_path, line)
    assert "line 7" in str(e.value) or "line 6" in str(e.value)


# --- the README's table ----------------------------------------------------------------

def test_readme_lists_every_cluster_file_field_from_the_schema():
    """The table between the markers is `fields_table()`'s output, as
    `scripts/cluster_fields.py --write` writes it: a field added to the schema
    without the README fails here."""
    text = README.read_text()
    start, end = "<!-- cluster-fields:start -->\n", "<!-- cluster-fields:end -->"
    assert start in text and end in text, "README.md lacks the cluster-fields markers"
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == fields_table().strip(), "README's cluster-file table is stale: run scripts/cluster_fields.py --write"
    for key in ("memory_gib", "nics_per_node", "peer_to_peer", "host_bandwidth", "memory_fraction", "process_reserve_gib",
                "overlap", "flops.bf16"):
        assert key in table
