"""1D, 2D and 3D tensor parallelism for large matmuls on 64 devices, as the sharding
ILP lays them out (hetpar/shard/strategies.py, solver/intra_op.py).

The matmuls are a training step's: two MLP blocks on a residual stream,
h <- h + relu(h W1) W2, with h of M x K (tokens x hidden) and each W of K x K, their
backward and the weights' update, traced on abstract shapes (nothing is allocated).
Each block's matmuls are square and large (16384 by default), so a layout's
communication is what an activation and a weight of that size cost to move. The
ILP shards the step on three meshes of 64 devices:
  1D  data(1) x model(64)             Megatron's split over one axis
  2D  data(8) x model(8)              each operand split over a pair of axes (SUMMA-like)
  3D  data(4) x model(4) x model2(4)  operands over pairs, each matmul over the triple
      (Colossal-AI's 3D matmul: rows, contraction and columns each on their own axis)
The ILP picks each mesh's layouts by time (A100 bf16 matmul rate, NVLink); the
communication of the layouts it picked is then counted in bytes per device: the
same ILP prices the same choices over a link of 1 byte/s without latency and with
free compute, so its objective is the bytes the chosen collectives move per device
(all-reduce 2(a-1)/a, all-gather (a-1)/a of the message over an a-device axis: the
bandwidth term of the fastest algorithm). Also printed: each mesh's predicted time
for the step's matmuls and collectives under the ILP, and the weight state per device.
Then what hetpar chooses by itself: the sharding pass's chooser
(hetpar/shard/model_axes.py) given the 4 x 16 mesh, which solves it and its
factorings 4 x 2 x 8 and 4 x 4 x 4 and keeps the cheapest, and the planning passes
end to end (planner, then the sharding pass) on examples/clusters/a100_64.yaml (8
nodes of 8 A100s): the meshes its stages get and its predicted step.
Ends with RESULT comm_bytes_1d=<b> comm_bytes_2d=<b> comm_bytes_3d=<b> (per device,
one step) three_d_least=<0|1> auto_picks_3d=<0|1> (the planning passes put a stage on
a 3-axis mesh).
Run: .venv/bin/python benchmarks/tensor_3d.py [--tokens 16384 --hidden 16384]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from hetpar.cluster.catalog import device_type
from hetpar.cluster.cluster import Cluster
from hetpar.pipeline import solve
from hetpar.shard.model_axes import choose_model_axes
from hetpar.shard.strategies import stage_problem
from hetpar.trace.traced_step import trace_step
from solver.collectives import LinkCost
from solver.intra_op import IntraOpProblem, solve_intra_op

MESHES = {
    "1D": {"data": 1, "model": 64},
    "2D": {"data": 8, "model": 8},
    "3D": {"data": 4, "model": 4, "model2": 4},
}
CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
BYTES = LinkCost(1.0, 0.0)  # seconds over it are bytes per device


BLOCKS = 2


def step(weights: tuple, x: jax.Array) -> tuple[tuple, jax.Array]:
    def loss(weights: tuple) -> jax.Array:
        h = x
        for w1, w2 in weights:
            h = h + jax.nn.relu(h @ w1) @ w2
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    value, grads = jax.value_and_grad(loss)(weights)
    return jax.tree.map(lambda w, g: w - (1e-3 * g).astype(w.dtype), weights, grads), value


def evaluate(problem: IntraOpProblem, choice: tuple[int, ...]) -> float:
    """The communication of `choice` under `problem`'s prices: each node's collectives
    and each edge's resharding."""
    comm = sum(node.strategies[c].comm_s for node, c in zip(problem.nodes, choice))
    return comm + sum(edge.cost_s[choice[edge.src]][choice[edge.dst]] for edge in problem.edges)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=16384)
    args = parser.parse_args()
    dtype = jnp.bfloat16
    square = jax.ShapeDtypeStruct((args.hidden, args.hidden), dtype)
    weights = tuple((square, square) for _ in range(BLOCKS))
    x = jax.ShapeDtypeStruct((args.tokens, args.hidden), dtype)
    traced = trace_step(step, (weights, x), 1, 1)
    graph = traced.full
    held = {v for v in graph.invars if v not in traced.analysis.batch_axis}
    a100 = device_type("A100-80GB")
    link = LinkCost(a100.intra_node_link.bandwidth, a100.intra_node_link.latency)
    flops = a100.sustained_matmul_flops("bfloat16")
    ops = list(range(len(graph.ops)))
    print(f"{BLOCKS} MLP blocks, h {args.tokens} x {args.hidden}, W {args.hidden} x {args.hidden}, bf16, forward + "
          f"backward + update, on 64 devices")
    result = {}
    for label, mesh in MESHES.items():
        timed = stage_problem(graph, ops, held, mesh, flops, link, batch_axis=traced.analysis.batch_axis)
        counted = stage_problem(graph, ops, held, mesh, float("inf"), BYTES, batch_axis=traced.analysis.batch_axis)
        solution = solve_intra_op(timed.problem)
        comm_bytes = evaluate(counted.problem, solution.choice)
        state = sum(node.strategies[c].memory_bytes for node, c in zip(timed.problem.nodes, solution.choice))
        layouts = sorted({timed.problem.nodes[n].strategies[c].name for n, c in enumerate(solution.choice)})
        result[label] = comm_bytes
        print(f"{label} {'x'.join(str(v) for v in mesh.values())}: communication {comm_bytes / 2**20:,.1f} MiB per device, "
              f"step {solution.cost_s * 1e3:.2f} ms predicted, weight state {state / 2**20:,.1f} MiB per device")
        print(f"   layouts: {'; '.join(layouts)}")
    least = int(result["3D"] < min(result["1D"], result["2D"]))

    solved: dict[str, float] = {}

    def cost_of(mesh: dict[str, int], beat: float) -> float:  # every mesh solved in full, to print its cost
        problem = stage_problem(graph, ops, held, mesh, flops, link, batch_axis=traced.analysis.batch_axis)
        solved["x".join(map(str, mesh.values()))] = cost = solve_intra_op(problem.problem).cost_s
        return cost

    shape, _ = choose_model_axes((4, 16), cost_of)
    print(f"chooser, given 4x16: {'x'.join(map(str, shape))} (ILP step of the matmuls and collectives: "
          f"{', '.join(f'{m} {c * 1e3:.2f} ms' for m, c in solved.items())})")
    plan = solve(traced, Cluster.from_file(str(CLUSTERS / "a100_64.yaml")).numbered())
    meshes = ", ".join(f"stage {s.index}: {'x'.join(map(str, s.mesh_shape))}" for s in plan.stages)
    auto = int(any(len(s.mesh_shape) == 3 for s in plan.stages))
    print(f"planned end to end on a100_64.yaml: {meshes}; step {plan.predicted_step_time_s * 1e3:.2f} ms predicted")
    print(f"RESULT comm_bytes_1d={result['1D']:.0f} comm_bytes_2d={result['2D']:.0f} comm_bytes_3d={result['3D']:.0f} "
          f"three_d_least={least} auto_picks_3d={auto}")


if __name__ == "__main__":
    main()
