#!/usr/bin/env bash
# Run a training script with torchrun on this machine, any number of processes, CPU (gloo) or GPU (nccl).
#
#   NPROC=4 bash launch/local.sh pretrain_llama.py --model-preset llama-tiny --mock-data \
#       --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8
#   DRY_RUN=1 NPROC=8 bash launch/local.sh pretrain_gpt.py ...   # print the command only
#
# NPROC defaults to the number of GPUs, or 2 without GPUs. Uses .venv of this repository when present.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: [NPROC=N] bash $0 TRAINING_SCRIPT [training flags...]" >&2
  exit 2
fi
[ -f .venv/bin/activate ] && . .venv/bin/activate
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
CMD=(python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
exec "${CMD[@]}"
