"""`hetpar launch`: start one process per host of a cluster file and watch them.

Locally (tests, one machine) every node of the cluster file becomes a process on
this machine with its own virtual CPU devices (`devices_per_node` of them, labelled
by the group's device type through the cluster file), all joined by
`jax.distributed` over loopback. The launcher is also the job's watchdog: when a
process dies, exits with an error, or records one in its status file, the others
are stopped within half a second (SIGTERM, then SIGKILL; the pause lets a dying
peer be reaped, so the process blamed is the first to fail, not one its death
brought down) and the launch fails with a HetparError that names the process, its
stages and the cause. On a real cluster the same
processes are placed one per machine by Ray (hetpar/runtime/ray_launcher.py), by
SLURM (`srun`, with `jax.distributed`'s auto-detection), or started by hand with
the same environment (README, "Many processes, many machines").
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from hetpar.cluster.cluster import Cluster
from hetpar.errors import HetparError
from hetpar.runtime import distributed as dist
from hetpar.runtime.children import Child, Terminated, check_command, stop_all, stop_signals_raise

log = logging.getLogger("hetpar.launch")


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the job: node `node` of group `group` (a device type)."""

    process_id: int
    group: str
    device_type: str
    node: int
    num_devices: int


def process_layout(cluster: Cluster) -> list[ProcessSpec]:
    """One process per node, in the cluster file's order: groups, then their nodes.
    Global device positions follow the same order, so `Cluster.bind()` in every
    process gives each group the devices of its own processes."""
    out = []
    for g in cluster.groups:
        for node in range(g.nodes):
            out.append(ProcessSpec(len(out), g.label, g.type_name, node, g.devices_per_node))
    return out


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free on `host` now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cpu_collectives(cluster: Cluster) -> str:
    """What a local launch uses between its processes' CPU devices. With one node
    per group no stage mesh can span processes (a stage's devices are one group's),
    so each process keeps XLA's in-process collectives: gloo would carry every
    all-reduce inside a stage over TCP too, at about 10 ms each on loopback
    (README, "Many processes"). A group of several nodes may get a stage across
    them, which needs gloo. HETPAR_CPU_COLLECTIVES in the environment overrides."""
    return "gloo" if any(g.nodes > 1 for g in cluster.groups) else "local"


def collective_settings(wanted: Mapping[str, str] | None, base: Mapping[str, str]) -> dict[str, str]:
    """The collective library's settings a launch adds to its processes' environment
    (`wanted`: what the algorithms the plan uses need, e.g. NCCL_COLLNET_ENABLE=1 for
    the in-network all-reduce), less any the user's environment (`base`) already sets:
    a setting made on purpose is kept."""
    wanted = dict(wanted or {})
    kept = sorted(k for k in wanted if k in base and base[k] != wanted[k])
    if kept:
        log.info("keeping the environment's %s over the plan's collective settings",
                 ", ".join(f"{k}={base[k]}" for k in kept))
    added = {k: v for k, v in wanted.items() if k not in base}
    if added:
        log.info("collective library settings for the plan: %s", " ".join(f"{k}={v}" for k, v in sorted(added.items())))
    return added


def launch_local(cluster: Cluster, command: Sequence[str], timeout_s: float | None = None,
                 env: dict[str, str] | None = None, grace_s: float = 5.0, port: int | None = None,
                 cluster_file: str | None = None, collective_env: Mapping[str, str] | None = None) -> None:
    """Runs `command` once per process of `cluster` on this machine and waits for all
    of them. Returns when every process exited 0; otherwise stops the others and
    raises a HetparError naming the first that failed, with its last lines. A signal
    to the launcher (Ctrl-C, SIGTERM, SIGHUP; not one it was started ignoring, as
    under nohup) stops every process first; SIGKILL
    reaches them through their parent-death signal (hetpar/runtime/children.py).
    `port` is the coordinator's (default: a free one). `cluster_file`, the file
    `cluster` was read from, is passed on to the processes (`launched_cluster`).
    `collective_env`: the collective library's settings the plan's algorithms need
    (`collective_settings`)."""
    if not command:
        raise HetparError("hetpar launch needs a command after '--', e.g. hetpar launch --cluster c.yaml -- python train.py")
    check_command(command)
    layout = process_layout(cluster)
    if port is not None:
        check_port_free(port)
    ports = free_ports(len(layout) + 1)
    if port is not None:
        ports[0] = port
    status_dir = tempfile.mkdtemp(prefix="hetpar-launch-")
    children: list[Child] = []
    base = dict(os.environ if env is None else env)
    base.update(collective_settings(collective_env, base))
    with stop_signals_raise():
        try:
            for spec in layout:
                child_env = dict(base)
                child_env.update({
                    dist.ENV_COORDINATOR: f"127.0.0.1:{ports[0]}",
                    dist.ENV_NUM_PROCESSES: str(len(layout)),
                    dist.ENV_PROCESS_ID: str(spec.process_id),
                    dist.ENV_TRANSFER_ADDRESS: f"127.0.0.1:{ports[1 + spec.process_id]}",
                    dist.ENV_CPU_DEVICES: str(spec.num_devices),
                    dist.ENV_STATUS_DIR: status_dir,
                    dist.ENV_CPU_COLLECTIVES: base.get(dist.ENV_CPU_COLLECTIVES) or cpu_collectives(cluster),
                    "JAX_PLATFORMS": base.get("JAX_PLATFORMS", "cpu"),
                })
                if cluster_file is not None:
                    child_env[dist.ENV_CLUSTER_FILE] = os.path.abspath(cluster_file)
                children.append(Child(command, child_env, f"process {spec.process_id}"))
            log.info("launched %d processes (status in %s)", len(children), status_dir)
            _watch(children, layout, status_dir, timeout_s, grace_s)
        except KeyboardInterrupt:
            stop_all(children, grace_s)
            raise Interrupted(f"interrupted (Ctrl-C): stopped all {len(children)} processes") from None
        except Terminated as e:
            stop_all(children, grace_s)
            raise Interrupted(f"the launcher received {e}: stopped all {len(children)} processes") from None


class ProcessFailed(HetparError):
    """A process of the job failed: which one, and whether it was lost (killed by a
    signal, or stopped answering) rather than ending with an error of its own."""

    def __init__(self, message: str, spec: ProcessSpec, lost: bool) -> None:
        super().__init__(message)
        self.spec = spec
        self.lost = lost


class Interrupted(HetparError):
    """The launch was stopped from outside (Ctrl-C or a signal), not by a failure;
    the CLI exits with the shell's code for an interrupted command."""

    exit_code = 130


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """A coordinator port another program holds is one line here; JAX's coordination
    service would crash on it instead."""
    if not 0 < port < 65536:
        raise HetparError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed job's TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError:
            raise HetparError(f"port {port} on {host} is in use by another program: choose another --port, "
                              "or leave --port out to take a free one") from None


def _watch(children: list[Child], layout: list[ProcessSpec], status_dir: str,
           timeout_s: float | None, grace_s: float) -> None:
    start = time.monotonic()
    while True:
        codes = [c.poll() for c in children]
        if all(code == 0 for code in codes):
            return
        failed = _first_failure(children, codes, status_dir)
        if failed is not None:
            # An error may be the consequence of a peer's death the kernel has not
            # finished yet (a large process takes a while to exit): look again once
            # it has had time to, before blaming anyone.
            time.sleep(SETTLE_S)
            codes = [c.poll() for c in children]
            failed = _first_failure(children, codes, status_dir)
            last = children[failed].last_lines()
            stop_all(children, grace_s)
            status = dist.read_status(status_dir, failed)
            message = describe_failure(failed, codes[failed], layout, status, len(children))
            raise ProcessFailed(message + _quoted(last), layout[failed], lost=was_lost(codes[failed], status))
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            stop_all(children, grace_s)
            raise HetparError(f"the job did not finish within {timeout_s:.0f} s; all {len(children)} processes were "
                              "stopped (raise --timeout if it needs longer)")
        time.sleep(0.1)


# Signals a process sends itself when it fails (XLA's abort after a stuck collective,
# a crash in native code): the process failed, its node did not go away.
SELF_INFLICTED = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})


def was_lost(code: int | None, status: dict) -> bool:
    """Whether a failed process was lost (killed from outside, before the launcher
    stopped anything: a node going away) rather than failing by itself (an error of
    its own, an exit status, an abort)."""
    return not status.get("error") and code is not None and code < 0 and -code not in SELF_INFLICTED


COARSE_S = 0.05
SETTLE_S = 0.5


def _first_failure(children: list[Child], codes: list[int | None], status_dir: str) -> int | None:
    """The process that failed first: by when it exited (timed by its waiter thread)
    or wrote its error (the status file's time), whichever came first. The others
    usually fail because of it, often before the launcher looks again.

    A process killed from outside (`was_lost`) is the cause whatever the clocks say:
    no failure of a peer sends it a signal, while its peers' errors (a closed socket
    in a transfer) follow its death within milliseconds, and on a busy machine its
    waiter thread may time the death after them."""
    when: dict[int, float] = {}
    lost: list[int] = []
    now_wall, now = time.time(), time.monotonic()
    for i, (child, code) in enumerate(zip(children, codes)):
        if code not in (None, 0):
            when[i] = child.end_time()
            if was_lost(code, dist.read_status(status_dir, i)):
                lost.append(i)
        path = os.path.join(status_dir, f"process-{i}.json")
        if dist.read_status(status_dir, i).get("error"):
            try:  # file times come from a coarse kernel clock: an error written within
                # COARSE_S of another process's death is taken as its consequence
                wrote = now - (now_wall - os.path.getmtime(path)) + COARSE_S
            except OSError:
                wrote = now
            when[i] = min(when.get(i, wrote), wrote)
    candidates = lost or list(when)
    return min(candidates, key=lambda i: (when[i], i)) if candidates else None


def _quoted(lines: list[str]) -> str:
    lines = [line for line in lines if line.strip()]
    if not lines:
        return ""
    return "\nIts last lines:\n" + "\n".join(f"  | {line}" for line in lines)


def describe_failure(i: int, code: int | None, layout: list[ProcessSpec], status: dict, count: int) -> str:
    """One line: the process, its device type, node and stages, what happened, and
    which processes were stopped because of it."""
    spec = layout[i]
    stages = status.get("stages")
    where = f"process {i} ({spec.device_type} node {spec.node} of group {spec.group}"
    where += f", stages {stages})" if stages is not None else ", before it was given stages)"
    others = [j for j in range(count) if j != i]
    stopped = f"; stopped process(es) {', '.join(map(str, others))}" if others else ""
    restart = " Restart the job from your last checkpoint." if status.get("step") else ""
    if status.get("error"):
        return f"{where}: {status['error'].rstrip('.')}{stopped}.{restart}"
    step = status.get("step")
    during = f" during step {step}" if step else ""
    if code is None:
        how = "stopped answering"
    elif -code in SELF_INFLICTED:
        how = f"crashed ({signal.Signals(-code).name}: its last lines say why)"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with status {code}"
    return f"{where} {how}{during}{stopped}.{restart}"


def main_command(argv: Sequence[str]) -> list[str]:
    """The command after `--`, with `python` meaning this interpreter."""
    command = list(argv)
    if command and command[0] == "python":
        command[0] = sys.executable
    return command
