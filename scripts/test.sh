#!/usr/bin/env bash
# Runs the whole test suite. Needs PostgreSQL on 127.0.0.1:5432 (database "test") and Redis on 127.0.0.1:6379.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
