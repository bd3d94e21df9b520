#!/usr/bin/env bash
# The README's test command: set up (once), then run the whole suite (CPU, gloo, several processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
exec python -m pytest -q tests "$@"
