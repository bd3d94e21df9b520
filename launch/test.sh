#!/usr/bin/env bash
# The README's test command: set up (once), run the whole suite (CPU, gloo, several processes), then check
# that docs/reproduction.md records what the code computes for every full-scale paper cell (no measurement,
# a few CPU minutes) and that every figure README.md and docs/ render from a committed JSON agrees with it
# (dev/render_docs.py, seconds). Arguments go to pytest and skip both checks (a partial run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
python -m pytest -q tests "$@"
if [ "$#" -eq 0 ]; then
  python tools/reproduce.py all --check
  python dev/render_docs.py --check
fi
