"""A train step over processes on jax.distributed: every process runs this script.

    hetpar launch --cluster examples/clusters/two_processes.yaml -- python examples/multiprocess_train.py

On a real cluster, start it once per machine (README, "Many processes, many
machines"); the cluster file then describes the machines, one node each.
"""

import sys

import hetpar

hetpar.initialize_distributed()  # first: joins the job hetpar launch (or Ray, SLURM) started

import jax  # noqa: E402

from models import gpt  # noqa: E402

cluster_file = sys.argv[1] if len(sys.argv) > 1 else "examples/clusters/two_processes.yaml"
w = gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128))
step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.from_file(cluster_file).bind(), num_stages=2,
                          num_microbatches=2, num_layers=2)
state = w.state
for i in range(3):
    state, loss = step(state, w.batch)  # parameters stay on their stage's devices between steps
    loss = float(hetpar.to_host(loss))  # every process takes part; each gets the number
    if jax.process_index() == 0:
        print(f"step {i}: loss {loss:.4f} on {jax.process_count()} processes, stages {step.plan.num_stages}")
