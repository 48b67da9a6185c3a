"""The multi-controller runtime: `hetpar launch` starts real processes on loopback,
each running tests/distributed_checks.py (every check against `jax.jit` on one
device). One launch runs several checks, to keep process start-ups few."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "distributed_checks.py"
TWO = ROOT / "tests" / "clusters" / "mp_two.yaml"
FOUR = ROOT / "tests" / "clusters" / "mp_four.yaml"
UNEVEN = ROOT / "tests" / "clusters" / "mp_uneven.yaml"


def launch(cluster: Path, *checks: str, timeout_s: float = 400, ray: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    command = [sys.executable, "-m", "hetpar.cli", "launch", "--cluster", str(cluster), "--timeout", str(timeout_s - 30),
               *(["--ray", "--virtual"] if ray else []), "--", "python", str(CHECKS), str(cluster), *checks]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    return result, time.time()


def _assert_all_gone(output: str) -> None:
    pids = [int(p) for p in re.findall(r"PID (\d+)", output)]
    assert pids, "the checks printed no process ids"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_launcher_stops_the_others_when_one_exits():
    """No JAX: process 1 exits with status 3 while process 0 sleeps; the launch fails
    at once naming process 1, and process 0 is gone."""
    import hetpar
    from hetpar.runtime.launcher import launch_local

    script = ("import os, time; print('PID', os.getpid(), flush=True)\n"
              "if os.environ['HETPAR_PROCESS_ID'] == '1': raise SystemExit(3)\n"
              "time.sleep(120)")
    start = time.time()
    with pytest.raises(hetpar.HetparError, match=r"process 1 \(V100 node 0 of group v100, before it was given stages\) "
                       r"exited with status 3; stopped process\(es\) 0"):
        launch_local(hetpar.Cluster.from_file(str(TWO)), [sys.executable, "-c", script], timeout_s=60)
    assert time.time() - start < 30


def test_stages_in_different_processes_need_meshes_of_one_size_where_one_spans_processes():
    from types import SimpleNamespace

    from hetpar import PlanError
    from hetpar.runtime.distributed import check_cross_process

    devices = [SimpleNamespace(process_index=p) for p in (0, 0, 1)]
    stage = lambda i, ids, shape=(): SimpleNamespace(index=i, device_ids=ids, mesh_shape=shape)  # noqa: E731
    check_cross_process(SimpleNamespace(stages=[stage(0, (0,)), stage(1, (2,))]), devices)
    check_cross_process(SimpleNamespace(stages=[stage(0, (0, 1), (1, 2)), stage(1, (0, 1), (2, 1))]), devices)  # one process
    # Meshes of different sizes, each within one process: a value crosses through one device.
    check_cross_process(SimpleNamespace(stages=[stage(0, (0, 1)), stage(1, (2,))]), devices)
    four = [SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 2)]
    with pytest.raises(PlanError, match=r"stages 0 and 1 run in different processes with meshes of different sizes "
                       r"\(4 and 1 devices\) and one of them spans processes"):
        check_cross_process(SimpleNamespace(stages=[stage(0, (0, 1, 2, 3)), stage(1, (4,))]), four)
    # Without cross-process collectives (CPU, HETPAR_CPU_COLLECTIVES=local) no stage may span processes.
    check_cross_process(SimpleNamespace(stages=[stage(0, (0,)), stage(1, (2,))]), devices, collectives=False)
    with pytest.raises(PlanError, match=r"stage 0 spans processes \[0, 1\].*HETPAR_CPU_COLLECTIVES=gloo"):
        check_cross_process(SimpleNamespace(stages=[stage(0, (1, 2))]), devices, collectives=False)


def test_launch_keeps_in_process_collectives_unless_a_group_has_several_nodes():
    """One node per group: no stage can span processes, so no gloo (which would carry
    every all-reduce inside a process over TCP); several nodes: gloo. A wrong value
    is refused before JAX starts."""
    import hetpar
    from hetpar.runtime.distributed import initialize
    from hetpar.runtime.launcher import cpu_collectives

    assert cpu_collectives(hetpar.Cluster.from_file(str(TWO))) == "local"
    assert cpu_collectives(hetpar.Cluster.from_file(str(FOUR))) == "gloo"
    with pytest.raises(hetpar.HetparError, match=r"HETPAR_CPU_COLLECTIVES\) must be one of gloo, local, got 'nccl'"):
        initialize(cpu_collectives="nccl")


def test_two_processes_pipeline_schedules_and_uneven_replicas():
    """One stage per process (A100 process, V100 process), 3 steps with the state
    resident (no device-to-host transfer in steps 2-3): GPipe on meshes of 2 and 2
    devices, then the runtime matrix's cases (interleaved chunks, dropout, ZeRO-3:
    tests/test_runtime_matrix.py); 1F1B on meshes of 4 and 2 (values cross through
    one device); then two replicas of different kinds and sizes with uneven batch shares.
    Also: processes whose step closes over different constants, or whose plans
    differ, all stop before a step naming the field (hetpar/runtime/identity.py); and a
    checkpoint saved by both processes, restored, resumed under another plan."""
    result, _ = launch(TWO, "gpipe", "matrix", "identity", "checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("pipeline-gpipe", "matrix-interleaved", "matrix-dropout", "matrix-zero3", "identity", "checkpoint"):
        assert f"CHECK {name} ok" in result.stdout, result.stdout[-2000:]
    result, _ = launch(UNEVEN, "1f1b", "replicas")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("pipeline-1f1b", "replicas", "replicas-uneven"):
        assert f"CHECK {name} ok" in result.stdout, result.stdout[-2000:]


def test_mixed_kind_stage_across_two_processes():
    """A stage whose parts are an A100 mesh in one process and a V100 mesh in the
    other, 3 + 2 rows of every microbatch: parity with jax.jit (tests/distributed_checks.py)."""
    result, _ = launch(UNEVEN, "mixed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CHECK mixed ok" in result.stdout, result.stdout[-2000:]


def test_four_processes_stages_span_two_processes():
    """Two stages, each a 2x2 mesh over two processes; values re-laid on their way
    between them."""
    result, _ = launch(FOUR, "spanning")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CHECK spanning ok" in result.stdout, result.stdout[-2000:]
    assert "CHECK relayout ok" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_failing_process_stops_the_job(fault):
    """Process 1 raises in (or is killed during) stage 1 of step 2: within 60 s every
    process has ended and the launch fails naming the process and the stage."""
    result, ended = launch(TWO, fault, timeout_s=300)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    injected = re.search(r"INJECT (\d+\.\d{3})", result.stdout)
    assert injected, result.stdout[-2000:]
    assert ended - float(injected.group(1)) < 60
    message = next(line for line in result.stderr.splitlines() if line.startswith("hetpar: "))
    assert message.startswith("hetpar: process 1 (V100 node 0 of group v100, stages [1])"), message
    assert "stopped process(es) 0" in message
    if fault == "raise":
        assert "failed in stage 1 (fwd program) during step 2: RuntimeError: injected fault" in message
        # Then its own last lines: its traceback, through the user's frame, to the fault.
        quoted = result.stderr.split("Its last lines:", 1)[1]
        assert "distributed_checks.py\", line" in quoted and "RuntimeError: injected fault" in quoted
    else:
        assert "was killed by SIGKILL during step 2" in message
    _assert_all_gone(result.stdout)


def test_ray_places_the_processes():
    """`hetpar launch --ray`: the same two processes as Ray actors on a local Ray
    instance; they join one job and move a value between their meshes. (Their output
    goes to Ray's logs: success is every process exiting 0, which the check's
    assertions decide.)"""
    result, _ = launch(TWO, "transfer", timeout_s=300, ray=True)
    assert result.returncode == 0, result.stderr[-3000:]
