"""JAX's persistent compilation cache, on by default for hetpar's programs.

A parallelized step compiles one program per stage and kind; for a real model that
is tens of seconds on the first step of every run. JAX can keep compiled programs on
disk and reuse them in the next process that compiles the same program for the same
devices (a restart, a restored checkpoint, the next experiment with the same model):
`parallelize` turns that cache on unless the user chose otherwise.

Where: `$HETPAR_COMPILATION_CACHE` if set to a path; else JAX's own setting if the
user set one (`jax_compilation_cache_dir`, `JAX_COMPILATION_CACHE_DIR`); else
`$XDG_CACHE_HOME/hetpar/jax` (`~/.cache/hetpar/jax`). `HETPAR_COMPILATION_CACHE=0`
(or `off`) leaves it off. JAX's own thresholds apply: a program that compiles in
under `jax_persistent_cache_min_compile_time_secs` (1 s by default) is not written,
as reading it back would cost about as much. The cache is trusted code: keep it in
a directory only you can write (JAX's warning).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger("hetpar.compile")

ENV = "HETPAR_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "none", "")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetpar" / "jax"


def enable_compilation_cache() -> str | None:
    """Turns JAX's persistent compilation cache on (see the module docstring); returns
    its directory, or None where it is off. Cheap to call again: the choice is made
    once per process, unless the environment or JAX's setting changed since."""
    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in _OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and (setting is None or current == setting):
        return current  # the user's own choice, or ours already
    path = Path(setting).expanduser() if setting else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("hetpar: no persistent compilation cache (cannot make %s: %s); set %s to a writable "
                    "directory, or to 0 to silence this", path, e.strerror, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    log.info("hetpar: JAX's persistent compilation cache is %s (%s=0 turns it off)", path, ENV)
    return str(path)
