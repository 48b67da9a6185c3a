#!/usr/bin/env bash
# Creates the project's virtual environment (.venv) with a Python >= 3.12 and installs
# hetpar into it. JAX >= 0.11 and current flax need Python >= 3.12, and many machines
# still default to an older python3, so look for a suitable interpreter explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."

python_ok() {  # usable interpreter of version >= 3.12?
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local candidate
  for candidate in "${HETPAR_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$candidate" ] && python_ok "$candidate" && { command -v "$candidate"; return; }
  done
  # pyenv installs versions side by side; their shims refuse to run unless selected.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
  for candidate in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
    python_ok "$candidate/bin/python" && { echo "$candidate/bin/python"; return; }
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! python_ok .venv/bin/python; then
  py="$(find_python)" || {
    echo "setup: no Python >= 3.12 found (tried python3.12, python3.13, python3, pyenv versions)." >&2
    echo "setup: install one (e.g. 'pyenv install 3.12') or set HETPAR_PYTHON=/path/to/python3.12." >&2
    exit 1
  }
  echo "setup: creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi

stamp=.venv/.hetpar-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev]'
  touch "$stamp"
fi
echo "setup: ready ($(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
