"""Memory per device of a GPT stage on 4 devices, as XLA reports it for the compiled
stage programs (`compiled.memory_analysis()`).

Section "zero": the state one device holds (parameters, gradients, Adam's two
moments: the arguments of the stage's optimizer-update program) with the state
replicated over the 4-way data axis, and at ZeRO-1, -2 and -3. The goal on 4 devices
is ZeRO-3 at most 0.3 of replicated (the ideal is 0.25: everything split 4 ways).
Each section is one function returning its RESULT figures; main prints them on one
line: RESULT zero3_over_replicated=<ratio>
Run: PYTHONPATH=. .venv/bin/python benchmarks/memory.py
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from hetpar.options import ShardingOption  # noqa: E402
from models import gpt  # noqa: E402

DEVICES = 4


def _config(args: argparse.Namespace) -> gpt.GPTConfig:
    return gpt.GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=32, vocab_size=256)


def _stage_memory(workload, **options) -> dict[str, object]:
    """One step of `workload` as a single stage on DEVICES devices; each compiled
    program's memory analysis, by task kind."""
    step = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual({"cpu": DEVICES}), num_stages=1,
                              num_microbatches=2, **options)
    step(workload.state, workload.batch)
    return {p.task.kind: p.lower().compile().memory_analysis() for p in step.compiled().programs}


def zero_section(args: argparse.Namespace) -> dict[str, float]:
    """State bytes per device at ZeRO 0-3 (the update program's arguments: every
    parameter, its gradient and its optimizer state, as one device holds them)."""
    workload = gpt.setup(batch_size=args.batch_size, config=_config(args))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(workload.state.params))
    print(f"GPT stage: {params / 2**20:.2f} MiB of parameters, Adam, {DEVICES} devices (data axis {DEVICES})")
    print(f"  {'state':<11} {'state/device':>13} {'x replicated':>13} {'fwd+bwd peak/device':>20}")
    state = {}
    for zero in (0, 1, 2, 3):
        memory = _stage_memory(workload, sharding_option=ShardingOption(zero=zero))
        state[zero] = memory["post"].argument_size_in_bytes
        # The last (here: only) stage's forward and backward are one program.
        work = memory["fwd"]
        peak = work.argument_size_in_bytes + work.temp_size_in_bytes + work.output_size_in_bytes - work.alias_size_in_bytes
        name = "replicated" if zero == 0 else f"ZeRO-{zero}"
        print(f"  {name:<11} {state[zero] / 2**20:>9.2f} MiB {state[zero] / state[0]:>13.3f} {peak / 2**20:>16.2f} MiB")
    return {"zero3_over_replicated": state[3] / state[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    args = parser.parse_args()
    results = {}
    results.update(zero_section(args))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
