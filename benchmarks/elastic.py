"""Elastic training on this machine: four processes under `hetpar launch --elastic`,
one killed (SIGKILL) mid-run; the launcher restarts the job on the three left, the
planner plans for them, and training resumes from the latest checkpoint.

    .venv/bin/python benchmarks/elastic.py [--steps 8 --every 2 --kill-after 4]

Prints `RESULT elastic_resume_s=<t> loss_matches=<0|1> lost_steps=<n>`:
- elastic_resume_s: from the kill to the first step finished after the restart
  (stopping the others, new processes, JAX start-up, planning, compiling);
- loss_matches: every loss after the restart equals `jax.jit(step)` on one device
  run from the same checkpoint (relative 1e-5);
- lost_steps: steps finished before the kill that the restart ran again.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"STEP (\d+) loss (\S+) processes (\d+) from (\d+)")


@dataclass
class ElasticRun:
    resume_s: float
    losses_after: dict[int, float]  # step -> loss, after the restart
    resumed_from: int
    lost_steps: int
    processes_after: int
    folder: Path
    output: str


def run(steps: int = 8, every: int = 2, kill_after: int = 4, kill_process: int = 3,
        timeout_s: float = 400) -> ElasticRun:
    """Runs the example under the elastic launcher and kills process `kill_process`
    right after step `kill_after` is printed (during the next step)."""
    folder = Path(tempfile.mkdtemp(prefix="hetpar-elastic-ckpt-"))
    command = [sys.executable, "-m", "hetpar.cli", "launch", "--elastic", "--timeout", str(timeout_s),
               "--cluster", str(ROOT / "examples" / "clusters" / "four_processes.yaml"), "--",
               "python", str(ROOT / "examples" / "elastic_train.py"), "--steps", str(steps), "--every", str(every),
               "--folder", str(folder)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    launcher = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed_at = resumed_at = None
    done_before: set[int] = set()
    after: dict[int, float] = {}
    resumed_from = processes_after = -1
    watchdog = threading.Timer(timeout_s + 60, launcher.kill)
    watchdog.start()
    try:
        for line in launcher.stdout:
            lines.append(line)
            match = STEP.search(line)
            if not match:
                continue
            i, loss, processes, start = int(match[1]), float(match[2]), int(match[3]), int(match[4])
            if killed_at is None:
                done_before.add(i)
                if i == kill_after:
                    _kill(launcher.pid, kill_process)
                    killed_at = time.monotonic()
            elif processes < 4:
                resumed_at = resumed_at or time.monotonic()
                after[i], resumed_from, processes_after = loss, start, processes
        launcher.wait()
    finally:
        watchdog.cancel()
    output = "".join(lines)
    if launcher.returncode != 0 or killed_at is None or resumed_at is None:
        raise RuntimeError(f"the elastic run did not resume (launcher status {launcher.returncode}):\n{output[-4000:]}")
    lost = len([i for i in done_before if i >= resumed_from])
    return ElasticRun(resumed_at - killed_at, after, resumed_from, lost, processes_after, folder, output)


def _kill(launcher: int, process: int) -> None:
    """SIGKILL to the launched process whose HETPAR_PROCESS_ID is `process`."""
    for child in _children(launcher):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HETPAR_PROCESS_ID={process}".encode() in environ:
            os.kill(child, signal.SIGKILL)
            return
    raise RuntimeError(f"no launched process {process} to kill among {_children(launcher)}")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def reference_losses(run: ElasticRun, steps: int) -> dict[int, float]:
    """`jax.jit(step)` on one device from the checkpoint the restart resumed from."""
    import jax

    sys.path.insert(0, str(ROOT / "examples"))
    import elastic_train

    import hetpar

    w = elastic_train.workload()
    state = w.state  # no checkpoint was complete: the restart began again from the start
    if run.resumed_from > 0:
        state = hetpar.restore_checkpoint(run.folder / f"step_{run.resumed_from}", like=w.state)
    step = jax.jit(w.step)
    out = {}
    for i in range(run.resumed_from, steps):
        state, loss = step(state, elastic_train.batch_at(w, i))
        out[i] = float(loss)
    return out


def losses_match(got: dict[int, float], expected: dict[int, float], rtol: float = 1e-5) -> bool:
    return got.keys() == expected.keys() and all(abs(got[i] - expected[i]) <= rtol * abs(expected[i]) for i in got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=4)
    args = parser.parse_args()
    result = run(args.steps, args.every, args.kill_after)
    expected = reference_losses(result, args.steps)
    for i in sorted(result.losses_after):
        print(f"step {i}: loss {result.losses_after[i]:.7f} after the restart ({result.processes_after} processes), "
              f"jax.jit from step_{result.resumed_from}: {expected[i]:.7f}")
    print(f"RESULT elastic_resume_s={result.resume_s:.1f} loss_matches={int(losses_match(result.losses_after, expected))} "
          f"lost_steps={result.lost_steps}")


if __name__ == "__main__":
    main()
