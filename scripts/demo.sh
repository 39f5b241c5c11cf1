#!/usr/bin/env bash
# Install sparkqueue (with Spark) into .venv and run the demo job on a local namespace (./sparkqueue-data) with Spark in
# local mode. Extra arguments go to the demo (python -m jobs.demo --help); --verbose shows Spark's and the library's log.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# An editable install in "strict" mode (links under build/, on sys.path through a .pth file): Spark finds the
# `sparkqueue` data source by listing sys.path (pkgutil.iter_modules), which the default editable mode's import
# hook does not show, so `spark.read.format("sparkqueue")` would work only from the clone's root.
.venv/bin/python -m pip install -q -e ".[spark]" --config-settings editable_mode=strict
args=("$@")
if ! command -v java >/dev/null 2>&1; then
  echo "Java was not found: running the demo without its Spark half (install Java 17 for it)." >&2
  args+=("--no-spark")
fi
.venv/bin/python -m jobs.demo "${args[@]}"
