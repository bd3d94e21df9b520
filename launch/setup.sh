#!/usr/bin/env bash
# Create .venv (once) with torch and megatron_pp installed editable. Idempotent: a second run is quick.
# TORCH_SPEC picks the torch to install: the default is the CPU build CI uses; on a GPU cluster set
# e.g. TORCH_SPEC="torch==2.11.0" or TORCH_SPEC=skip to keep the torch already in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# Test-only: the Megatron-Core release the checkpoint conversion tests check against (its wheel needs only
# torch, numpy and packaging, installed already; --no-deps keeps pip from resolving torch again).
MEGATRON_CORE_SPEC=megatron-core==0.16.1
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.megatron_pp_installed ] || [ setup.py -nt .venv/.megatron_pp_installed ] ||
   [ launch/setup.sh -nt .venv/.megatron_pp_installed ]; then
  python -m pip install -q --upgrade pip
  if [ "$TORCH_SPEC" != skip ]; then
    python -m pip install -q "$TORCH_SPEC"
  fi
  python -m pip install -q -e ".[dev]"
  python -m pip install -q --no-deps "$MEGATRON_CORE_SPEC"
  touch .venv/.megatron_pp_installed
fi
