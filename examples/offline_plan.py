"""Plan offline, keep the plan as a file, run it later: the path from a laptop to a cluster.

1. Solve for a cluster file, here with the command line as a user would:
       hetpar solve examples/offline_plan.py:small_gpt --cluster examples/clusters/virtual_8.yaml \\
           --batch-size 16 --microbatches 4 --layers 4 -o plan.json
       hetpar show plan.json
       hetpar simulate plan.json --plot timeline.png
   (`large_gpt` plans a model too big for this machine: its arguments are abstract;
   so does `llama2_7b`, e.g. on 32 V100s only, where its state fits sharded:
       hetpar solve examples/offline_plan.py:llama2_7b --cluster examples/clusters/v100_32.yaml -o plan.json)
2. Load the plan and run it, here on 8 CPU virtual devices standing in for the cluster.
Run: .venv/bin/python examples/offline_plan.py
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from models import gpt  # noqa: E402

HERE = Path(__file__).parent


def small_gpt(batch_size: int = 16) -> gpt.Workload:
    return gpt.setup(batch_size=batch_size, config=gpt.GPTConfig(n_layers=4))


def large_gpt(batch_size: int = 64) -> tuple:
    """A 24-block, 1024-wide GPT as abstract arguments: planning it needs its shapes only."""
    config = gpt.GPTConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=32000)
    built = {}

    def build():
        w = gpt.setup(batch_size=batch_size, config=config)
        built["step"] = w.step
        return w.state, w.batch

    state, batch = jax.eval_shape(build)
    return built["step"], (state, batch)


def llama2_7b(batch_size: int = 64):  # noqa: ANN201
    """Llama-2-7B (f32 parameters, bf16 compute, AdamW), abstract: shapes only."""
    from models import llama

    return llama.setup(batch_size, llama.LLAMA2_7B, abstract=True)


def main() -> None:
    plan_path = Path(tempfile.mkdtemp()) / "plan.json"
    hetpar_cli = [sys.executable, "-m", "hetpar.cli"]
    subprocess.run(
        [*hetpar_cli, "solve", f"{__file__}:small_gpt", "--cluster", str(HERE / "clusters" / "virtual_8.yaml"),
         "--batch-size", "16", "--microbatches", "4", "--layers", "4", "-o", str(plan_path)],
        check=True,
    )
    subprocess.run([*hetpar_cli, "simulate", str(plan_path)], check=True)

    workload = small_gpt()
    train_step = hetpar.parallelize(workload.step, plan=str(plan_path))  # the plan's cluster, on this process's devices
    reference = jax.jit(workload.step)
    state = ref_state = workload.state
    for i in range(3):
        state, loss = train_step(state, workload.batch)
        ref_state, ref_loss = reference(ref_state, workload.batch)
        print(f"step {i}: hetpar loss {float(loss):.6f}, jax.jit loss {float(ref_loss):.6f}")


if __name__ == "__main__":
    main()
