"""The runtime's host work as a profile times it (hetpar/runtime/host_cost.py): the
interpreter walks a compiled step's schedule over recorded results (no program, split
or copy runs), and the batch split runs on its own."""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest

from hetpar.compile.programs import stage_mesh
from hetpar.compile.step import compile_layer_stages
from hetpar.predict.layer_profile import with_batch
from hetpar.runtime import executor
from hetpar.runtime.host_cost import _Recording, host_runs, step_arguments
from hetpar.runtime.interpreter import interpret
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import build_layers
from hetpar.trace.traced_step import trace_step
from models import gpt


@pytest.fixture(scope="module")
def two_meshes():
    w = gpt.setup(batch_size=8)
    traced = trace_step(w.step, with_batch((w.state, w.batch), 1, 8), 1, 2)
    layers = build_layers(traced.full, traced.analysis, [c.flops for c in op_costs(traced.full)], 4)
    meshes = {0: stage_mesh((0, 1)), 1: stage_mesh((2, 3))}
    return compile_layer_stages(traced, layers, [0, 0, 1, 1], meshes)


def test_the_interpreter_is_timed_alone_over_a_steps_recorded_results(two_meshes, monkeypatch):
    runs = host_runs(two_meshes)
    per_microbatch = sum(p.task.per_microbatch for p in two_meshes.programs)
    assert runs.dispatches == per_microbatch * 2 + sum(not p.task.per_microbatch for p in two_meshes.programs)
    assert runs.split is not None and len(runs.split()) >= 1  # the batch cut for each stage that reads it

    def no_device_work(*_):
        raise AssertionError("the interpreter's run dispatched device work")

    for name in ("call", "call_fused", "split", "merge", "concatenate"):
        monkeypatch.setattr(executor.DeviceTransport, name, no_device_work)
    monkeypatch.setattr(jax, "device_put", no_device_work)  # a value between the two meshes is not copied
    for _ in range(2):  # and it replays as often as it is timed
        assert runs.interpreter() is None


def test_a_step_taking_a_prng_key_has_no_zero_arguments(two_meshes):
    assert len(step_arguments(two_meshes)) == len(two_meshes.graph.invars)
    key = jax.random.key(0)
    graph = two_meshes.graph
    avals = list(graph.avals)
    avals[graph.invars[0]] = jax.ShapeDtypeStruct((), key.dtype)
    keyed = replace(two_meshes, graph=replace(graph, avals=avals))
    assert step_arguments(keyed) is None and host_runs(keyed) is None


def test_recording_a_step_keeps_none_of_its_values(two_meshes):
    """The record of what each call returned holds shapes, dtypes and shardings only:
    holding the values too (every stage's activations, a second new state) made
    `hetpar profile --layers` of a 1.26B Llama run out of a 141 GB GPU's memory."""
    recording = _Recording(executor.DeviceTransport(two_meshes))
    outputs = interpret(two_meshes, recording, step_arguments(two_meshes))
    jax.block_until_ready(outputs)
    kept = jax.tree.leaves(recording.returned)
    assert kept and all(isinstance(x, jax.ShapeDtypeStruct) for x in kept if hasattr(x, "shape"))
    assert any(isinstance(x, jax.Array) for x in jax.tree.leaves(outputs))  # the step itself still got them


def test_a_steps_zero_arguments_are_one_array_per_shape_dtype_and_placement(two_meshes):
    """The step's programs donate only their accumulators, so its arguments may share
    one array of zeros: a model's identical blocks then hold one block's zeros (a
    whole state more beside the profile's runs ran a 1.26B Llama out of an H100)."""
    args = step_arguments(two_meshes)
    groups: dict = {}
    for a in args:
        groups.setdefault((a.shape, a.dtype, a.sharding), []).append(a)
    assert any(len(same) > 1 for same in groups.values()), "gpt's blocks have weights of one shape"
    assert all(x is same[0] for same in groups.values() for x in same)
    assert len({id(a) for a in args}) == len(groups)
