"""Metis's own planner beside hetpar's, on the same machine and Metis's scenarios
(`search_scale.py`'s GPT ones: 10 and 34 layers, 16/64/256 GPUs, two and three kinds).

Metis (Um et al., ATC'24) is github.com/SamsungLabs/Metis, licensed CC BY-NC 4.0: it is
no part of hetpar. Clone it and pass its folder; it runs unmodified. It plans from
profiles (per device kind, tensor-parallel degree 1, 2, 4 and batch size 1, 2, 4, each
layer's forward and backward milliseconds and megabytes; sizes 8, 16 and 32 too, which
its memory estimate of a stage mixing kinds looks up), a host file and a cluster file.
They are written here, per scenario, from the problem hetpar plans: each layer's FLOPs at
its kind's achievable rate (hetpar's catalog), its state (16 bytes a parameter, the
problem's) and activations over the tensor-parallel degree, the kinds' memory and
links. Metis's search knobs are its README's example's (min_group_scale_variance 1,
max_permute_len 4). Metis enumerates its space and prices every plan its memory
estimate lets through, so the figures change its time only through what fits (ad hoc
figures from the GPT's shape, tried first, let through the same 38 plans on 64 GPUs of
two kinds); hetpar's search does not read these files.

Each round runs both searches from inputs already loaded, one after the other (who goes
first alternates): Metis's `cost_het_cluster` (its printing of every plan sent to
/dev/null) and hetpar's `Planner.solve` on `search_scale.py`'s problem. Per scenario:
each side's median wall seconds, the rounds' median ratio (hetpar over Metis), how many
plans Metis priced, and both chosen plans. A Metis search over 60 s is not repeated (its
one time stands in every round's ratio), and one is stopped at `--limit` seconds
(default 600: on 64 GPUs it prices thousands of plans, tens of milliseconds each), its
time then a floor and the ratio a ceiling.

Ends with RESULT <scenario>=<hetpar/Metis> ... faster=<scenarios where hetpar took less>/<scenarios>
stopped=<scenarios whose Metis search met the limit>
Run: .venv/bin/python benchmarks/metis_side_by_side.py --metis PATH [--scenario NAME ...] [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_scale import SCENARIOS, Scenario  # noqa: E402

from solver.planner import Planner, Problem  # noqa: E402

NAMES = [name for name in SCENARIOS if name.startswith("gpt")]
TP, BATCHES, LOOKED_UP = (1, 2, 4), (1, 2, 4), (8, 16, 32)
KNOBS = dict(min_group_scale_variance=1, max_permute_len=4)
ONCE_PAST_S = 60.0
SYNC_MS = 0.1  # what the forward and backward take beyond their layers' (Metis's fb_sync, which it needs above 0)


def profile(problem: Problem, kind: str, tp: int, batch: int) -> dict:
    """One Metis profile file's figures (its README's format) for `kind` at this degree and batch."""
    k = problem.kind(kind)
    times = [layer.flops * batch / (tp * k.flops) * 1e3 for layer in problem.layers]
    memory = [(layer.param_bytes * problem.state_factor + layer.saved_bytes * batch) / tp / 2**20 for layer in problem.layers]
    optimizer = sum(layer.param_bytes for layer in problem.layers) * problem.optimizer_traffic / tp / k.memory_bandwidth * 1e3
    return {
        "model": {"model_name": "GPT", "num_layers": len(problem.layers), "parameters": {
            "total_parameters_bytes": sum(layer.param_bytes for layer in problem.layers),
            "parameters_per_layer_bytes": [layer.param_bytes for layer in problem.layers],
            "activation_parameters_bytes": [layer.input_bytes * batch for layer in problem.layers]}},
        "execution_time": {
            "total_time_ms": sum(times) + SYNC_MS + optimizer, "forward_backward_time_ms": sum(times) + SYNC_MS,
            "batch_generator_time_ms": 0.0,
            "layernorm_grads_all_reduce_time_ms": 0.0, "embedding_grads_all_reduce_time_ms": 0.0,
            "optimizer_time_ms": optimizer, "layer_compute_total_ms": times},
        "execution_memory": {"total_memory_mb": sum(memory), "layer_memory_total_mb": memory},
    }


def metis_inputs(scenario: Scenario, problem: Problem, folder: Path) -> list[str]:
    """Writes the scenario's host file, cluster file and profiles; returns the command line
    Metis's script would run (Metis reads its arguments again during the search)."""
    hosts, nodes = [], {}
    for kind in problem.kinds:  # (Metis takes the first node's size for every node's: 8, but 16 GPUs' V100 and T4 nodes hold 4)
        for _ in range(max(1, kind.count // kind.devices_per_node)):
            address = f"10.0.{len(hosts) // 250}.{len(hosts) % 250 + 1}"
            hosts.append(f"{address} slots={min(kind.count, kind.devices_per_node)}")
            nodes[address] = dict(instance_type=kind.name.upper(), memory=round(kind.memory_bytes / 2**30),  # GB
                                  # GB/s: Metis adds bytes over its figure times 2^20 to milliseconds
                                  intra_bandwidth=kind.intra.bandwidth / 1e9, inter_bandwidth=kind.inter.bandwidth / 1e9)
    (folder / "hostfile").write_text("\n".join(hosts) + "\n")
    (folder / "clusterfile.json").write_text(json.dumps(nodes))
    (folder / "profile").mkdir()
    for kind in problem.kinds:
        for tp in TP:
            for batch in BATCHES + LOOKED_UP:
                (folder / "profile" / f"DeviceType.{kind.name.upper()}_tp{tp}_bs{batch}.json").write_text(
                    json.dumps(profile(problem, kind.name, tp, batch)))
    model = scenario.model
    return ["cost_het_cluster.py", "--model_name=GPT", "--model_size=1.5B", f"--num_layers={model.layers}",
            f"--gbs={scenario.batch}", f"--hidden_size={model.hidden}", f"--sequence_length={model.seq}",
            f"--vocab_size={model.vocab}", f"--attention_head_size={model.heads}", f"--hostfile_path={folder}/hostfile",
            f"--clusterfile_path={folder}/clusterfile.json", f"--profile_data_path={folder}/profile",
            f"--max_profiled_tp_degree={max(TP)}", f"--max_profiled_batch_size={max(BATCHES)}",
            *(f"--{knob}={value}" for knob, value in KNOBS.items()), f"--home_dir={folder}", f"--log_path={folder}"]


class Metis:
    """Metis's planner from its folder, its inputs loaded as its script loads them (untimed)."""

    def __init__(self, path: str):
        sys.path.insert(0, path)
        from cost_het_cluster import cost_het_cluster  # Metis's modules, by their own names

        self.search = cost_het_cluster

    def load(self, argv: list[str]) -> tuple:
        from arguments import parse_args
        from data_loader import ProfileDataLoader
        from gpu_cluster import GPUCluster
        from model.activation_parameter import GPTActivationAndParam
        from model.cost_estimator import HeteroCostEstimator
        from model.load_balancer import LayerLoadBalancer
        from utils import ModelConfig

        with _argv(argv):
            args = parse_args()
        cluster = GPUCluster(hostfile_path=args.hostfile_path, clusterfile_path=args.clusterfile_path)
        profiles, _ = ProfileDataLoader(args.profile_data_path).load_profile_data_all()
        config = ModelConfig(model_name=args.model_name, num_layers=args.num_layers, sequence_length=args.sequence_length,
                             vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                             attention_head_size=args.attention_head_size)
        estimator = HeteroCostEstimator(profiles, config, GPTActivationAndParam(config, profiles["model"]["parameters"]), cluster)
        return args, cluster, profiles, config, estimator, LayerLoadBalancer(cluster, profiles, config, args.gbs)

    def run(self, argv: list[str], inputs: tuple, limit_s: float) -> tuple[float, list | None]:
        """Its search's wall seconds and the plans it priced (cost last); stopped at
        `limit_s` (a timer's signal raised inside it), its plans then None."""
        def stop(*_: object) -> None:
            raise _OverLimit

        previous = signal.signal(signal.SIGALRM, stop)
        try:
            with _argv(argv), open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                started = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, limit_s)
                plans = self.search(*inputs)
                signal.setitimer(signal.ITIMER_REAL, 0)
                return time.perf_counter() - started, plans
        except _OverLimit:
            return time.perf_counter() - started, None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


class _OverLimit(Exception):
    """A Metis search stopped at its time limit."""


@contextlib.contextmanager
def _argv(argv: list[str]):  # noqa: ANN202
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metis", required=True, help="a checkout of github.com/SamsungLabs/Metis")
    parser.add_argument("--scenario", choices=NAMES, action="append")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a Metis search may run (default %(default)s)")
    args = parser.parse_args()
    if not (Path(args.metis) / "cost_het_cluster.py").is_file():
        parser.error(f"{args.metis} holds no cost_het_cluster.py: pass a checkout of github.com/SamsungLabs/Metis")
    metis = Metis(args.metis)
    ratios: dict[str, float] = {}
    stopped = 0  # scenarios whose Metis search met the limit (their ratios ceilings)
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.scenario or NAMES:
            scenario = SCENARIOS[name]
            folder = Path(scratch) / name
            folder.mkdir()
            argv = metis_inputs(scenario, scenario.problem(), folder)
            theirs, ours, rounds, plans, chosen = [], [], [], [], None
            for r in range(args.rounds):
                for side in ("metis", "hetpar") if r % 2 == 0 else ("hetpar", "metis"):
                    if side == "metis" and not (theirs and (theirs[0] > ONCE_PAST_S or plans is None)):
                        seconds, plans = metis.run(argv, metis.load(argv), args.limit)
                        theirs.append(seconds)
                    elif side == "hetpar":
                        problem = scenario.problem()
                        started = time.perf_counter()
                        chosen = Planner(problem, top_k=1).solve().best
                        ours.append(time.perf_counter() - started)
                rounds.append(ours[-1] / theirs[-1])
            ratios[name], stopped = statistics.median(rounds), stopped + (plans is None)
            best = min(plans, key=lambda p: p[-1]) if plans else None
            priced = "stopped at the limit: at least" if plans is None else f"{len(plans)} plans priced"
            print(f"{name}: Metis {statistics.median(theirs):.3f} s ({len(theirs)} runs, {priced}), "
                  f"hetpar {statistics.median(ours):.3f} s; hetpar/Metis {ratios[name]:.3f}"
                  + (" at most" if plans is None else "") + f" (the {len(rounds)} rounds' median)")
            if best is not None:
                print(f"  Metis: {[t.name for t in best[0]]} groups {best[1]} (dp, tp) {best[2]} layers {best[4]}")
            print(f"  hetpar: {chosen.describe()}", flush=True)
    faster = sum(ratio < 1 for ratio in ratios.values())
    print("RESULT " + " ".join(f"{name}={ratio:.3f}" for name, ratio in ratios.items())
          + f" faster={faster}/{len(ratios)} stopped={stopped}")


if __name__ == "__main__":
    main()
