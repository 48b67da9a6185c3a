"""Where the command line prints tables: as wide as the terminal, and wide enough
to stay readable when the output goes to a file or a pipe."""

from __future__ import annotations

import shutil
import sys

from rich.console import Console


def console() -> Console:
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 160
    return Console(width=max(width, 100))
