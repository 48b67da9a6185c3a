"""The planner only emits plans the runtime can run, over random models, clusters,
batch sizes and microbatch counts; the small ones run with parity."""

from __future__ import annotations

import itertools
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from parity import run_parity, with_grads

import hetpar
from hetpar.plan.runnable import runnable_problems
from models import gpt, llama
from solver.collectives import LinkCost
from solver.planner import DeviceKind, LayerCost, PlanningError, Problem, plan
from solver.planner.problem import PlanChoice

GIB = 2**30


def random_problem(rng: np.random.Generator) -> Problem:
    n = int(rng.integers(1, 10))
    layers = tuple(
        LayerCost(float(f), float(f) / 3, int(rng.integers(1, 40)) * 2**22, float(rng.integers(1, 30)) * 2**20,
                  float(rng.integers(1, 8)) * 2**18, float(rng.integers(0, 4)) * 2**18)
        for f in rng.uniform(1e10, 1e12, n)
    )
    kinds = []
    for i in range(int(rng.integers(1, 4))):
        per_node = int(rng.choice([1, 2, 4, 8]))
        count = per_node * int(rng.integers(1, 4))
        kinds.append(DeviceKind(
            f"k{i}", count, per_node, float(rng.uniform(1e12, 1e13)), int(rng.uniform(2, 16) * GIB), 1e12,
            LinkCost(float(rng.uniform(5e10, 3e11)), 5e-6), LinkCost(float(rng.uniform(5e9, 5e10)), 1e-5),
        ))
    links = tuple((a.name, b.name, LinkCost(float(rng.uniform(1e9, 2e10)), 2e-5)) for a, b in itertools.combinations(kinds, 2))
    batch = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 30, 48]))
    divisors = [m for m in range(1, batch + 1) if batch % m == 0]
    microbatches = None if rng.random() < 0.5 else tuple(int(m) for m in rng.choice(divisors, size=min(2, len(divisors)), replace=False))
    return Problem(layers, tuple(kinds), batch, links, microbatches=microbatches, max_tp=int(rng.choice([1, 2, 8])),
                   min_microbatch=int(rng.choice([1, 2])) if batch % 2 == 0 else 1)


def choice_problems(problem: Problem, choice: PlanChoice) -> list[str]:
    """What keeps a planner's choice from running, checked from first principles."""
    out = []
    m = choice.num_microbatches
    if sum(choice.replica_batch) != problem.batch_size:
        out.append("batch not covered")
    used: dict[str, int] = {}
    for p, s in enumerate(choice.stages):  # a mixed stage's parts: the lead's layers, rows making up the microbatch
        parts = choice.parts(p)
        if s.part_of >= 0:
            used[s.kind] = used.get(s.kind, 0) + s.devices
        elif parts:
            b = choice.replica_batch[s.replica] // m
            if sum(q.examples for q in parts) != b or any(q.examples % q.dp or q.examples < 1 for q in parts):
                out.append(f"mixed stage {p}: rows {[q.examples for q in parts]} of {b} on dp {[q.dp for q in parts]}")
            if any((q.layer_start, q.layer_end, q.replica) != (s.layer_start, s.layer_end, s.replica) for q in parts):
                out.append(f"mixed stage {p}: parts on other layers")
            if choice.chunks > 1:
                out.append(f"mixed stage {p} under {choice.chunks} chunks")
    for r, share in enumerate(choice.replica_batch):
        stages = [s for s in choice.stages if s.replica == r and s.part_of < 0]
        ranges = [(s.layer_start, s.layer_end) for s in stages]
        if ranges[0][0] != 0 or ranges[-1][1] != len(problem.layers) or any(
                a[1] != b[0] for a, b in zip(ranges, ranges[1:])) or any(a >= b for a, b in ranges):
            out.append(f"replica {r} layers {ranges}")
        if share % m:
            out.append(f"replica {r}: {share} examples in {m} microbatches")
        groups = len(stages) // choice.chunks  # an interleaved plan's stage i runs on device group i mod groups
        if len(stages) % choice.chunks:
            out.append(f"replica {r}: {len(stages)} stages in {choice.chunks} chunks")
        for i, s in enumerate(stages):
            if (s.examples or share // m) % s.dp:
                out.append(f"{s.kind} dp{s.dp} on microbatches of {share // m}")
            if i >= groups and (s.kind, s.devices) != (stages[i % groups].kind, stages[i % groups].devices):
                out.append(f"stage {i}, a later chunk, is not on the devices of stage {i % groups}")
            if i < groups:
                used[s.kind] = used.get(s.kind, 0) + s.devices
    out += [f"{k} uses {n} of {problem.kind(k).count}" for k, n in used.items() if n > problem.kind(k).count]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_planner_choices_are_runnable(seed):
    problem = random_problem(np.random.default_rng(1000 + seed))
    try:
        result = plan(problem, top_k=3)
    except PlanningError as e:  # nothing fits is an answer, but a clear one
        assert "no plan" in str(e), e
        return
    for choice in (result.best, *result.alternatives):
        assert choice_problems(problem, choice) == [], choice.describe()


TYPES = ("A100", "V100", "H100")


def random_case(seed: int):
    """A tiny GPT or Llama, a virtual cluster of up to 8 devices, a batch and maybe a
    microbatch count (leaving 2+ examples per microbatch: size 1 traces apart)."""
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([2, 4, 6, 8, 12]))
    if rng.random() < 0.5:
        w = gpt.setup(batch, gpt.GPTConfig(n_layers=int(rng.integers(1, 4))), seed=seed)
    else:
        w = llama.setup(batch, llama.LlamaConfig(n_layers=int(rng.integers(1, 3)), dtype=jnp.float32), seed=seed)
    kinds = rng.choice(TYPES, size=int(rng.integers(1, 3)), replace=False)
    sizes = rng.multinomial(int(rng.integers(len(kinds), 9)) - len(kinds), [1 / len(kinds)] * len(kinds)) + 1
    counts = {str(k): int(n) for k, n in zip(kinds, sizes)}
    divisors = [m for m in range(1, batch // 2 + 1) if batch % m == 0]
    microbatches = None if rng.random() < 0.6 else int(rng.choice(divisors))
    return w, counts, batch, microbatches


CASES = [3, 5, 8, 13, 21, 34]


@pytest.fixture(scope="module")
def planned():
    out = {}
    for seed in CASES:
        w, counts, batch, microbatches = random_case(seed)
        cluster = hetpar.Cluster.virtual(counts)
        step = with_grads(w.loss_fn)  # the step run_parity runs
        out[seed] = (w, cluster, batch, hetpar.make_plan(step, (w.state, w.batch), cluster, num_microbatches=microbatches))
    return out


@pytest.mark.parametrize("seed", CASES)
def test_traced_plans_are_runnable(planned, seed):
    _, cluster, batch, p = planned[seed]
    assert runnable_problems(p, batch) == []
    positions = [d for s in p.stages for d in s.device_ids]
    assert len(positions) == len(set(positions)) and set(positions) <= set(range(cluster.num_devices))
    for r, share in enumerate(p.replica_batch or (batch,)):
        for s in p.replica_stages(r):
            assert (share // p.num_microbatches) % (s.data_parallel or s.num_devices) == 0


@pytest.mark.parametrize("seed", CASES[:3])
def test_traced_plans_run_with_parity(planned, seed):
    w, cluster, _, p = planned[seed]
    run_parity(w, cluster, steps=2, plan=p)


def test_runnable_names_a_data_axis_wider_than_the_microbatch(planned):
    _, _, batch, p = planned[CASES[0]]
    micro = (p.replica_batch[0] if p.replica_batch else batch) // p.num_microbatches
    bad = replace(p, stages=(replace(p.stages[0], data_parallel=micro + 1),) + p.stages[1:])
    assert any("splits its microbatch" in m for m in runnable_problems(bad, batch))
