"""What the planner sees of real model shapes: parameters behind mixed-precision
casts, Megatron's tensor-parallel traffic, forced recomputation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpar.cluster.cluster import Cluster
from hetpar.planner import SearchOptions, problem_for
from hetpar.solve import layers_of
from hetpar.trace.traced_step import trace_step
from models import llama
from solver.collectives import Topology, best
from solver.planner.search import Planner
from solver.planner.stage_costs import StageConfig

CONFIG = llama.LlamaConfig(n_layers=2, dtype=jnp.bfloat16, param_dtype=jnp.float32)
BATCH = 8


@pytest.fixture(scope="module")
def llama_layers():
    w = llama.setup(BATCH, CONFIG)
    traced = trace_step(w.step, (w.state, w.batch), 1, 2)
    return w, traced, layers_of(traced, 4)


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_file("examples/clusters/virtual_8.yaml").numbered()


def test_mixed_precision_parameters_are_counted(llama_layers):
    """f32 parameters cast to bf16 before use: their f32 bytes are the layers' parameters."""
    w, _, layers = llama_layers
    leaves = jax.tree.leaves(w.state.params)
    assert all(x.dtype == jnp.float32 for x in leaves)
    assert sum(x.size for x in leaves) == CONFIG.param_count()  # the hand count matches the model
    assert sum(layers.param_bytes) == 4 * CONFIG.param_count()
    d, v = CONFIG.d_model, CONFIG.vocab_size
    assert layers.param_bytes[0] >= 4 * v * d  # the embedding sits in the first layer
    assert layers.param_bytes[-1] >= 4 * (d * v + d)  # the head and final norm in the last


def test_gradient_sync_and_optimizer_see_the_parameters(llama_layers, cluster):
    """One 4-way data-parallel stage: it all-reduces every f32 gradient and updates
    every parameter, at the byte counts computed from the shapes."""
    _, _, layers = llama_layers
    problem = problem_for(layers, cluster, BATCH)
    kind = problem.kind("a100")
    choice = Planner(problem).fixed_split([StageConfig("a100", 4, 1)], 1, BATCH, "1f1b", ())
    nbytes = 4 * CONFIG.param_count()
    stage = choice.stages[0]
    expected_sync = best("all_reduce", Topology(1, 4, kind.intra, kind.inter), nbytes)[1]
    assert stage.sync_s > 0
    np.testing.assert_allclose(stage.sync_s, expected_sync, rtol=1e-9)
    np.testing.assert_allclose(stage.optimizer_s, nbytes * problem.optimizer_traffic / kind.memory_bandwidth, rtol=1e-9)
    assert stage.memory_bytes >= problem.state_factor * nbytes
