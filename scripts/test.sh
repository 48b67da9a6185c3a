#!/usr/bin/env bash
# Sets up the environment if needed, then runs the test suite on 8 CPU virtual devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist): the suite is CPU bound and most tests are independent;
# HETPAR_TEST_WORKERS=0 runs it in one process.
exec .venv/bin/python -m pytest -n "${HETPAR_TEST_WORKERS:-2}" "$@"
