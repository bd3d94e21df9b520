#!/usr/bin/env bash
# The README's main command: set up (once), build the demo corpus (once, cached: the standard library's
# docstrings, a BPE tokenizer trained on them, preprocessed to .bin/.idx), then pretrain a small GPT on
# that text with 2-stage pipeline parallelism (1F1B) on 2 CPU processes, reporting validation loss.
# Extra arguments are passed to pretrain_gpt.py and override the defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
mkdir -p runs
DATA_FLAGS=$(python -m megatron_pp.data.demo_corpus runs/demo-data)
eval "set -- $DATA_FLAGS \"\$@\""
exec torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
  --split 95,5,0 --seq-length 64 --max-position-embeddings 64 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 \
  --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b \
  --micro-batch-size 8 --global-batch-size 64 \
  --train-iters 120 --lr 2e-3 --lr-warmup-iters 10 --lr-decay-style cosine --min-lr 2e-4 \
  --eval-interval 30 --eval-iters 4 --log-interval 20 --metrics-file runs/demo_metrics.jsonl "$@"
