"""hetpar in one screen: a GPT train step, unmodified, pipelined over two device types.

8 CPU virtual devices stand in for 4 A100s and 4 V100s; the plan gives the faster
type more layers, and the losses match `jax.jit` on one device.
Run: scripts/demo.sh   (or .venv/bin/python examples/quickstart.py)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from models import gpt  # noqa: E402


def main() -> None:
    workload = gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=4))
    cluster = hetpar.Cluster.virtual({"H100": 4, "V100": 4})

    @hetpar.parallelize(cluster=cluster, num_microbatches=4, num_layers=4)
    def train_step(state, batch):
        return workload.step(state, batch)

    reference = jax.jit(workload.step)
    state = ref_state = workload.state
    rows = []
    for i in range(5):
        state, loss = train_step(state, workload.batch)
        ref_state, ref_loss = reference(ref_state, workload.batch)
        rows.append((i, float(loss), float(ref_loss)))

    print(train_step.plan)
    print()
    print(f"{'step':>4}  {'hetpar loss':>12}  {'jax.jit loss':>12}  {'|diff|':>9}")
    for i, loss, ref in rows:
        print(f"{i:>4}  {loss:>12.6f}  {ref:>12.6f}  {abs(loss - ref):>9.2e}")


if __name__ == "__main__":
    main()
