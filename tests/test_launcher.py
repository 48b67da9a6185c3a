"""`hetpar launch` as an operator meets it: signals to the launcher leave no process
behind, the process that failed first is the one named (with its last lines), and
a bad command, port or process id is one line. Real processes, no JAX in the
children (they only sleep, print or exit), so each test costs seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hetpar
from hetpar.cli import main as cli_main
from hetpar.runtime import launcher
from hetpar.runtime.launcher import launch_local

ROOT = Path(__file__).resolve().parent.parent
TWO = ROOT / "tests" / "clusters" / "mp_two.yaml"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper that is not ours."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _start_launcher(tmp_path, ignored: tuple[signal.Signals, ...] = ()) -> subprocess.Popen:
    """`hetpar launch` of two sleepers (each leaves its pid in `tmp_path`), started as
    a terminal's foreground job has its signals (default), whatever this test process
    inherited (a background job ignores SIGINT), but for `ignored` (nohup's SIGHUP)."""
    sleeper = f"import os, time; open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close(); time.sleep(120)"

    def dispositions() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)

    return subprocess.Popen(
        [sys.executable, "-m", "hetpar.cli", "launch", "--cluster", str(TWO), "--", "python", "-c", sleeper],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=dispositions)


def _kill_all(launcher: subprocess.Popen, tmp_path) -> None:
    if launcher.poll() is None:
        launcher.kill()
    for name in os.listdir(tmp_path):
        try:
            os.kill(int(name), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_leaves_no_process_behind(tmp_path, sig):
    launcher = _start_launcher(tmp_path)
    try:
        assert _wait_for(lambda: len(os.listdir(tmp_path)) == 2, 60), "the two processes did not start"
        children = [int(name) for name in os.listdir(tmp_path)]
        assert all(_alive(pid) for pid in children)
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=20)
        assert _wait_for(lambda: not any(_alive(pid) for pid in children), 10), \
            f"processes {[p for p in children if _alive(p)]} outlived the launcher after {sig.name}"
    finally:
        _kill_all(launcher, tmp_path)
    if sig != signal.SIGKILL:
        assert launcher.returncode == 130
        assert "Traceback" not in stderr
        assert "stopped all 2 processes" in stderr, stderr


def test_a_launcher_started_under_nohup_outlives_the_hangup(tmp_path):
    """SIGHUP ignored at the start (`nohup hetpar launch ...`) stays ignored: the job
    runs on after its terminal hangs up, and SIGTERM still stops it."""
    launcher = _start_launcher(tmp_path, ignored=(signal.SIGHUP,))
    try:
        assert _wait_for(lambda: len(os.listdir(tmp_path)) == 2, 60), "the two processes did not start"
        children = [int(name) for name in os.listdir(tmp_path)]
        launcher.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert launcher.poll() is None and all(_alive(pid) for pid in children), "SIGHUP stopped a job started under nohup"
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=20)
        assert _wait_for(lambda: not any(_alive(pid) for pid in children), 10)
    finally:
        _kill_all(launcher, tmp_path)
    assert launcher.returncode == 130 and "stopped all 2 processes" in stderr, stderr


def test_the_process_that_failed_first_is_named_with_its_last_lines(tmp_path):
    """Process 1 fails; process 0 exits with an error a moment later *because* of it
    (as a worker does when its coordinator goes). Both have ended by the time the
    launcher looks, and the lower id must not take the blame."""
    flag = tmp_path / "one-failed"
    script = (f"import os, sys, time\nflag = {str(flag)!r}\n"
              "if os.environ['HETPAR_PROCESS_ID'] == '1':\n"
              "    print('loading shard 7 of 9', flush=True)\n"
              "    print('shard 7 is corrupt', file=sys.stderr, flush=True)\n"
              "    open(flag, 'w').close(); raise SystemExit(3)\n"
              "while not os.path.exists(flag): time.sleep(0.001)\n"
              "time.sleep(0.03); raise SystemExit(1)\n")
    with pytest.raises(hetpar.HetparError) as error:
        launch_local(hetpar.Cluster.from_file(str(TWO)), [sys.executable, "-c", script], timeout_s=60)
    message = str(error.value)
    assert message.startswith("process 1 (V100 node 0 of group v100"), message
    assert "exited with status 3; stopped process(es) 0" in message
    assert "  | loading shard 7 of 9" in message and "  | shard 7 is corrupt" in message


def test_a_traceback_is_quoted_whole_however_much_stdout_follows(tmp_path):
    """A traceback of four frames (with Python's column markers), then twenty
    progress lines on stdout: the quote keeps every frame, from the script's own
    outermost one, and only the last few stdout lines."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys, traceback, time\n"
                      "def deep(n):\n"
                      "    return deep(n - 1) if n else 1 / (n * 1)\n"
                      "if os.environ['HETPAR_PROCESS_ID'] == '1':\n"
                      "    try:\n"
                      "        deep(2)\n"
                      "    except ZeroDivisionError:\n"
                      "        traceback.print_exc(); sys.stderr.flush()\n"
                      "    for i in range(20): print('progress', i, flush=True)\n"
                      "    raise SystemExit(3)\n"
                      "time.sleep(60)\n")
    with pytest.raises(hetpar.HetparError) as error:
        launch_local(hetpar.Cluster.from_file(str(TWO)), [sys.executable, str(script)], timeout_s=60)
    quoted = str(error.value).split("Its last lines:", 1)[1]
    assert "train.py\", line 6, in <module>" in quoted and "ZeroDivisionError: division by zero" in quoted, quoted
    assert "  | progress 19" in quoted and "progress 10" not in quoted, quoted
    assert "^^^" not in quoted, quoted


def test_a_command_that_does_not_exist_is_one_line(capsys):
    assert cli_main(["launch", "--cluster", str(TWO), "--", "no-such-program-hetpar"]) == 2
    err = capsys.readouterr().err
    assert "command not found: 'no-such-program-hetpar'" in err and "Traceback" not in err


def test_a_taken_port_is_one_line(capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli_main(["launch", "--cluster", str(TWO), "--port", str(port), "--", "python", "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use by another program: choose another --port" in err


def test_a_bad_process_id_or_coordinator_is_one_line():
    from hetpar.runtime import distributed

    with pytest.raises(hetpar.HetparError, match=r"process id 5 \(HETPAR_PROCESS_ID\) is outside 0\.\.1"):
        distributed.initialize(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=5)
    with pytest.raises(hetpar.HetparError, match=r"process id -1 .* is outside"):
        distributed.initialize(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=-1)
    with pytest.raises(hetpar.HetparError, match=r"must be host:port, got 'localhost'"):
        distributed.initialize(coordinator_address="localhost", num_processes=2, process_id=1)


def test_a_process_that_aborts_failed_and_a_killed_one_was_lost():
    # An abort (XLA after a stuck collective) or a crash is the process's own failure:
    # an elastic restart keeps its node. A SIGKILL or SIGTERM from outside loses it.
    assert not launcher.was_lost(-signal.SIGABRT, {})
    assert not launcher.was_lost(-signal.SIGSEGV, {})
    assert launcher.was_lost(-signal.SIGKILL, {})
    assert launcher.was_lost(-signal.SIGTERM, {})
    assert not launcher.was_lost(-signal.SIGKILL, {"error": "ValueError: ..."})
    assert not launcher.was_lost(1, {})


def test_collective_timeouts_leave_the_users_own_alone():
    from hetpar.runtime.stuck import collective_timeout_flags

    ours = collective_timeout_flags("--xla_foo=1", None)
    assert "--xla_foo=1" in ours and "terminate_timeout_seconds=5" in ours and "warn_stuck_timeout_seconds=3" in ours
    theirs = "--xla_cpu_collective_call_terminate_timeout_seconds=100"
    assert collective_timeout_flags(theirs, None).count("terminate_timeout_seconds") == 1
    assert theirs in collective_timeout_flags(theirs, None)
    assert collective_timeout_flags("", "0") == ""


def test_a_process_killed_from_outside_is_blamed_before_the_errors_it_caused(tmp_path):
    """Process 0's closed-socket error can be timed before process 1's SIGKILL (its
    waiter thread runs late on a busy machine): the killed one is still the cause.
    Without a kill, the earliest failure is."""
    import json
    from types import SimpleNamespace

    (tmp_path / "process-0.json").write_text(json.dumps({"error": "JaxRuntimeError: Connection closed"}))
    killed_late = [SimpleNamespace(end_time=lambda: 0.0), SimpleNamespace(end_time=lambda: time.monotonic() + 5.0)]
    assert launcher._first_failure(killed_late, [None, -signal.SIGKILL], str(tmp_path)) == 1
    assert launcher._first_failure(killed_late, [None, 1], str(tmp_path)) == 0  # an exit of its own is timed
    aborted = [SimpleNamespace(end_time=lambda: 0.0), SimpleNamespace(end_time=lambda: time.monotonic() + 5.0)]
    assert launcher._first_failure(aborted, [None, -signal.SIGABRT], str(tmp_path)) == 0
