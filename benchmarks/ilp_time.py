"""How long does the intra-op sharding ILP take on a 2 x 4 mesh?

Traces the GPT train step (forward, backward, Adam update) for one block and for a
24-block stage, builds the sharding problem of every matmul on a data(2) x model(4)
mesh (hetpar/shard/strategies.py) and solves it with OR-Tools CP-SAT
(solver/intra_op.py). Prints the problem sizes, the solve time, and whether the
answer is proven optimal (else its gap to the bound at the time limit).
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
from hetpar.trace.traced_step import trace_step  # noqa: E402
from models import gpt  # noqa: E402
from solver.collectives import LinkCost  # noqa: E402
from solver.intra_op import solve_intra_op  # noqa: E402

MESH = {"data": 2, "model": 4}


def solve_gpt(blocks: int, time_limit_s: float) -> tuple[float, int, int, bool, float]:
    config = gpt.GPTConfig(n_layers=blocks, d_model=256, n_heads=8, seq_len=64, vocab_size=512)
    w = gpt.setup(batch_size=16, config=config)
    traced = trace_step(w.step, (w.state, w.batch), 1, 1)
    graph = traced.full
    batch_free = {v for v in graph.invars if v not in traced.analysis.batch_axis}
    a100 = device_type("A100-80GB")
    link = LinkCost(a100.intra_node_link.bandwidth, a100.intra_node_link.latency)
    problem = stage_problem(graph, list(range(len(graph.ops))), batch_free, MESH, a100.matmul_flops(), link,
                            batch_axis=traced.analysis.batch_axis)
    started = time.perf_counter()
    solution = solve_intra_op(problem.problem, time_limit_s)
    seconds = time.perf_counter() - started
    strategies = sum(len(n.strategies) for n in problem.problem.nodes)
    print(f"{blocks:>2} block(s): {len(graph.ops)} operators, {len(problem.dots)} matmuls, {strategies} strategies, "
          f"{len(problem.problem.edges)} edges; solved in {seconds:.2f} s, "
          + ("optimal" if solution.optimal else f"gap {solution.gap:.1%} at the time limit"))
    return seconds, len(graph.ops), len(problem.dots), solution.optimal, solution.gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    block_s, _, _, _, _ = solve_gpt(1, args.time_limit)
    stage_s, ops, _, _, _ = solve_gpt(24, args.time_limit)
    print(f"RESULT block_solve_s={block_s:.2f} stage24_solve_s={stage_s:.2f} ops={ops}")


if __name__ == "__main__":
    main()
