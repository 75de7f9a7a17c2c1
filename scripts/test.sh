#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tk tests scripts examples benchmarks
# A crash prints Python's stacks; once pytest has reported, it exits without interpreter finalization
# (see pytest_unconfigure in tests/conftest.py: one CI run crashed there after every test had passed)
PYTHONFAULTHANDLER=1 TK_TESTS_EXIT_AFTER_REPORT=1 .venv/bin/python -m pytest "$@"
