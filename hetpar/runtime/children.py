"""The launcher's child processes: they cannot outlive it, their output passes
through with its last lines kept, and each records when it ended.

Why each part:
- A child runs in its own session (so stopping it stops whatever it started), which
  also means no terminal signal reaches it: a launcher killed by SIGKILL would leave
  it running. Each child therefore asks the kernel for a parent-death signal
  (`prctl(PR_SET_PDEATHSIG)`) before it executes the user's command, through a
  tiny exec shim (die_with_parent.py) rather than `preexec_fn`, which is unsafe
  once JAX has started threads in the launching process.
- When a job fails the user needs the failing process's own last lines, not a
  search through interleaved output; they are kept per process.
- The first process to fail is the one to blame: the others usually fail *because*
  of it (the coordinator went away), often within the same polling interval, so
  each child's exit is timed by a thread waiting on it.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from hetpar.errors import HetparError

TAIL_LINES = 12  # of stderr, where a traceback goes
STDOUT_LINES = 4  # of stdout: what the program said it was doing
# Python's column markers under a traceback's source lines: out of their place they
# only take room from the frames.
_MARKERS = re.compile(r"^\s*[\^~]+\s*$")
# Run by path with -S: importing the hetpar package (and so JAX) would cost seconds.
_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "die_with_parent.py")
_OUTPUT_LOCK = threading.Lock()


def check_command(command: Sequence[str]) -> None:
    """A command that cannot start is one line, before any process is launched."""
    program = command[0]
    if os.sep in program:
        if not os.path.isfile(program):
            raise HetparError(f"hetpar launch: {program} does not exist; give the program to run after '--'")
        if not os.access(program, os.X_OK):
            raise HetparError(f"hetpar launch: {program} is not executable (chmod +x it, or run it with python)")
    elif shutil.which(program) is None:
        raise HetparError(f"hetpar launch: command not found: {program!r} (is it on PATH? e.g. -- python train.py)")


class Child:
    """One launched process: its Popen, the last lines it wrote, when it ended."""

    def __init__(self, command: Sequence[str], env: dict[str, str], label: str) -> None:
        shim = [sys.executable, "-S", _SHIM, str(os.getpid()), "--", *command]
        self.popen = subprocess.Popen(shim, env=env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.label = label
        # Per stream, each line with its place in the order read: what the program
        # prints to stdout while its traceback is written must not push the
        # frames out of the lines quoted.
        self.tails: tuple[collections.deque[tuple[int, str]], ...] = (
            collections.deque(maxlen=STDOUT_LINES), collections.deque(maxlen=TAIL_LINES))
        self.ended_at: float | None = None
        self.lines_read = 0
        self._threads = [
            threading.Thread(target=self._forward, args=(self.popen.stdout, sys.stdout, self.tails[0]), daemon=True),
            threading.Thread(target=self._forward, args=(self.popen.stderr, sys.stderr, self.tails[1]), daemon=True),
            threading.Thread(target=self._time_exit, daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def end_time(self) -> float:
        """When it ended (call once `poll()` says it has): its waiter thread's time,
        which a poll that reaped the process first can be a moment ahead of."""
        self._threads[2].join(timeout=1.0)
        return self.ended_at if self.ended_at is not None else time.monotonic()

    def last_lines(self) -> list[str]:
        """What it wrote last (its last lines of stderr and a few of stdout, in the
        order written), taken before the launcher stops anyone (what the others
        print while being stopped is noise)."""
        if self.poll() is not None:
            for t in self._threads[:2]:  # its pipes are closing: let the readers finish
                t.join(timeout=0.5)
        else:  # it recorded an error and is printing its traceback: wait for a pause
            deadline = time.monotonic() + 2.0
            seen = -1
            while seen != self.lines_read and time.monotonic() < deadline and self.poll() is None:
                seen = self.lines_read
                time.sleep(0.2)
        return [line for _, line in sorted([*self.tails[0], *self.tails[1]])]

    def _forward(self, pipe: IO[bytes] | None, stream: IO[str], tail: collections.deque[tuple[int, str]]) -> None:
        if pipe is None:
            return
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self.lines_read += 1
            if not _MARKERS.match(line):
                tail.append((self.lines_read, line.rstrip("\n")))
            with _OUTPUT_LOCK:
                try:
                    stream.write(line)
                    stream.flush()
                except (OSError, ValueError):  # the launcher's own output closed: keep draining the child
                    pass
        pipe.close()

    def _time_exit(self) -> None:
        self.popen.wait()
        self.ended_at = time.monotonic()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


def stop_all(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM to every live child's session, SIGKILL to any left after `grace_s`."""
    for c in children:
        if c.poll() is None:
            c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.signal(signal.SIGKILL)
            c.popen.wait()


class Terminated(Exception):
    """The launcher itself was asked to stop (SIGTERM, SIGHUP)."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.signal = sig


class stop_signals_raise:
    """While active (main thread only), SIGTERM and SIGHUP raise `Terminated` in the
    launcher's main thread, so they stop the children like Ctrl-C does. A signal the
    launcher was started ignoring stays ignored, as Python leaves an ignored SIGINT:
    `nohup hetpar launch ...` asked to outlive its terminal's hangup."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> "stop_signals_raise":
        self.previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._raise)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @staticmethod
    def _raise(sig: int, frame: object) -> None:
        raise Terminated(sig)
