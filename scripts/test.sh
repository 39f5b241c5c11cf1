#!/usr/bin/env bash
# Install sparkqueue with its test extras into .venv (created if absent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Strict editable mode, as scripts/demo.sh explains: Spark must find pyspark_sparkqueue on sys.path.
.venv/bin/python -m pip install -q -e ".[test]" --config-settings editable_mode=strict
.venv/bin/ruff check sparkqueue pyspark_sparkqueue jobs tests bench scripts
.venv/bin/python scripts/check_layers.py
# The import layers (pyproject.toml [tool.importlinter]): the report is shown only when a layer is broken.
layers=$(.venv/bin/lint-imports --no-cache 2>&1) || { echo "$layers"; exit 1; }
.venv/bin/mypy sparkqueue pyspark_sparkqueue jobs
set +e
# Tests run in parallel workers (pytest-xdist); every Spark test runs in one of them, on one shared SparkSession.
# Most tests wait on processes, locks and I/O, so 3 workers fit 2 cores. `-n 0` runs them in this process.
.venv/bin/python -m pytest -n "${SPARKQUEUE_TEST_WORKERS:-3}" --dist loadgroup --durations=20 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure here, never a pass.
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
