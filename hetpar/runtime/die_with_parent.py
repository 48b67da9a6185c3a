"""`python -S die_with_parent.py LAUNCHER_PID -- COMMAND...`: the exec
shim every launched process starts through. It asks Linux to send it SIGKILL when
its parent dies, checks the launcher has not already died in between, then
becomes COMMAND (execvp keeps the parent-death signal). On other systems it only
execs: there the launcher's own signal handlers are the whole guarantee."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    launcher, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: python -S die_with_parent.py LAUNCHER_PID -- COMMAND...")
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(launcher):  # the launcher died before prctl took hold
            raise SystemExit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
