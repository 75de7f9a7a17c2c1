#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tk tests scripts examples
.venv/bin/python -m pytest "$@"
