#!/usr/bin/env bash
# Install sparkqueue (with Spark) into .venv and run the demo job on a local namespace with Spark in local mode.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[spark]"
.venv/bin/python -m jobs.demo "$@"
