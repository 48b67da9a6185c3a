#!/usr/bin/env bash
# Sets up the environment if needed, then runs the test suite on 8 CPU virtual devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
