"""How long does the intra-op sharding ILP take on a 2 x 4 mesh?

Traces the GPT train step (forward, backward, Adam update) for one block and for a
24-block stage, builds the sharding problem of every matmul on a data(2) x model(4)
mesh (hetpar/shard/strategies.py) and solves it with OR-Tools CP-SAT
(solver/intra_op.py). The matmuls of identical blocks are tied, so the solver
searches one block's choices however many blocks the stage has. Prints the problem
sizes, the solve time, and whether the answer is proven optimal among the plans
where identical blocks agree (else its gap to the bound at the time limit); with
--untied-check it also solves a 4-block stage untied, to show what tying gives up.
Ends with: RESULT block_solve_s=<s> stage24_solve_s=<s> ops=<n>
Run: .venv/bin/python benchmarks/ilp_time.py [--time-limit S]
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from hetpar.cluster.catalog import device_type  # noqa: E402
from hetpar.shard.strategies import stage_problem  # noqa: E402
from hetpar.pipeline import layers_of  # noqa: E402
from hetpar.trace.traced_step import trace_step  # noqa: E402
from models import gpt  # noqa: E402
from solver.collectives import LinkCost  # noqa: E402
from solver.intra_op import solve_intra_op  # noqa: E402

MESH = {"data": 2, "model": 4}


def solve_gpt(blocks: int, time_limit_s: float, tie: bool = True) -> tuple[float, int, float]:
    config = gpt.GPTConfig(n_layers=blocks, d_model=256, n_heads=8, seq_len=64, vocab_size=512)
    w = gpt.setup(batch_size=16, config=config)
    traced = trace_step(w.step, (w.state, w.batch), 1, 1)
    graph = traced.full
    batch_free = {v for v in graph.invars if v not in traced.analysis.batch_axis}
    a100 = device_type("A100-80GB")
    link = LinkCost(a100.intra_node_link.bandwidth, a100.intra_node_link.latency)
    problem = stage_problem(graph, list(range(len(graph.ops))), batch_free, MESH, a100.matmul_flops(), link,
                            batch_axis=traced.analysis.batch_axis,
                            op_layer=layers_of(traced, blocks).op_layer if tie else None)
    started = time.perf_counter()
    solution = solve_intra_op(problem.problem, time_limit_s)
    seconds = time.perf_counter() - started
    strategies = sum(len(n.strategies) for n in problem.problem.nodes)
    free = len(set(problem.problem.leaders()))
    print(f"{blocks:>2} block(s){'' if tie else ' untied'}: {len(graph.ops)} operators, {len(problem.dots)} matmuls "
          f"({free} free), {strategies} strategies, {len(problem.problem.edges)} edges; solved in {seconds:.2f} s, "
          f"cost {solution.cost_s * 1e3:.4f} ms, "
          + ("optimal" if solution.optimal else f"gap {solution.gap:.1%} at the time limit"))
    return seconds, len(graph.ops), solution.cost_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--untied-check", action="store_true", help="also solve a 4-block stage with and without ties")
    args = parser.parse_args()
    if args.untied_check:
        tied, untied = solve_gpt(4, args.time_limit)[2], solve_gpt(4, args.time_limit, tie=False)[2]
        print(f"4 blocks: tied cost / untied cost = {tied / untied:.4f}")
    block_s, _, _ = solve_gpt(1, args.time_limit)
    stage_s, ops, _ = solve_gpt(24, args.time_limit)
    print(f"RESULT block_solve_s={block_s:.2f} stage24_solve_s={stage_s:.2f} ops={ops}")


if __name__ == "__main__":
    main()
