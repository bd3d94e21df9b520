#!/usr/bin/env bash
# The README's main command: set up (once), then pretrain a tiny GPT with 2-stage pipeline parallelism
# (1F1B, 8 microbatches per step) on 2 CPU processes. Extra arguments are passed to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
mkdir -p runs
exec torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
  --model-preset gpt-tiny --mock-data \
  --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b \
  --micro-batch-size 4 --global-batch-size 32 \
  --train-iters 60 --lr 3e-3 --lr-warmup-iters 5 --lr-decay-style cosine --min-lr 3e-4 \
  --log-interval 10 --metrics-file runs/demo_metrics.jsonl "$@"
