#!/usr/bin/env bash
# The README's test command: set up (once), run the whole suite (CPU, gloo, several processes), then check
# that docs/reproduction.md records what the code computes for every full-scale paper cell (no measurement,
# a few CPU minutes) and that every figure README.md and docs/ render from a committed JSON agrees with it
# (dev/render_docs.py, seconds). Arguments go to pytest and skip both checks (a partial run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  # Two pytest workers (pytest-xdist; MEGATRON_PP_TEST_WORKERS=N for more cores, 0 for one process), each
  # taking whole modules (--dist loadfile), so a module's shared fixtures (a SLURM cluster, a corpus, a
  # training run several tests read) are built once; the multi-process tests' gloo pools are per worker.
  python -m pytest -q -n "${MEGATRON_PP_TEST_WORKERS:-2}" --dist loadfile tests
  python tools/reproduce.py all --check
  python dev/render_docs.py --check
else
  python -m pytest -q tests "$@"
fi
