"""Elastic training: a job that survives losing a process.

    hetpar launch --elastic --cluster examples/clusters/four_processes.yaml -- \
        python examples/elastic_train.py --steps 8 --every 2 --folder /tmp/hetpar-elastic

Every process runs this script. It plans for the cluster it was started on
(`hetpar.launched_cluster`: after a restart, the nodes that are left), resumes from
its latest checkpoint if there is one, and saves one every `--every` steps. When a
process is lost, `hetpar launch --elastic` stops the others and starts the script
again without that node: the planner plans for the smaller cluster and training
continues from the checkpoint. `benchmarks/elastic.py` kills a process mid-run and
checks the losses after the restart against `jax.jit` from that checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import hetpar

ROOT = Path(__file__).resolve().parent.parent


def workload():  # noqa: ANN201
    """The model and its first batch (the same on every process and every restart)."""
    sys.path.insert(0, str(ROOT))
    from models import gpt

    return gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=32, vocab_size=128))


def batch_at(w, step: int):  # noqa: ANN001, ANN201
    """Step `step`'s batch: the first batch rolled, so every step sees other data and a
    restart must resume at the right step to give the same losses."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.roll(x, step, axis=0), w.batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--folder", required=True, help="where the checkpoints go (step_<n> folders)")
    parser.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "four_processes.yaml"))
    args = parser.parse_args()

    hetpar.initialize_distributed()  # first: joins the job hetpar launch started
    import jax

    cluster = hetpar.launched_cluster(args.cluster)
    w = workload()
    state, start = w.state, 0
    latest = hetpar.latest_checkpoint(args.folder)
    if latest is not None:
        start, path = latest
        state = hetpar.restore_checkpoint(path, like=w.state)
    step = hetpar.parallelize(w.step, cluster=cluster, num_microbatches=2)
    for i in range(start, args.steps):
        state, loss = step(state, batch_at(w, i))
        loss = float(hetpar.to_host(loss))
        if jax.process_index() == 0:
            print(f"STEP {i} loss {loss:.7f} processes {jax.process_count()} from {start}", flush=True)
        if (i + 1) % args.every == 0:
            hetpar.save_checkpoint(Path(args.folder) / f"step_{i + 1}", state)


if __name__ == "__main__":
    main()
