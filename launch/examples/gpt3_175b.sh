#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020: 96 layers, hidden 12288, 96 heads, 2048 tokens) in the shape of a
# Megatron-LM launch script: the same flag names, grouped the same way. Run it on every node (torchrun
# per node; under SLURM, `srun --ntasks-per-node 1 bash launch/examples/gpt3_175b.sh` with NODE_RANK from
# SLURM_NODEID). 24 nodes x 8 GPUs = 192 GPUs: tensor parallel 8 inside a node, 12 pipeline stages with 2
# interleaved chunks of 4 layers each, data parallel 2.
#
#   DATA_PATH=/data/pile_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#   CHECKPOINT_PATH=/ckpt/gpt3-175b MASTER_ADDR=node001 NODE_RANK=0 bash launch/examples/gpt3_175b.sh
#   DRY_RUN=1 bash launch/examples/gpt3_175b.sh   # print the command only
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-24}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt3-175b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:-$ROOT/data/corpus_text_document}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/data/gpt2-merges.txt}

DISTRIBUTED_ARGS=(
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
GPT_MODEL_ARGS=(
  --num-layers 96 --hidden-size 12288 --num-attention-heads 96
  --seq-length 2048 --max-position-embeddings 2048
  --init-method-std 0.006 --attention-backend auto
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 1536 --train-iters 500000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16
  --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-iters 500 --lr-decay-iters 430000
  --recompute-granularity selective
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 8 --sequence-parallel
  --pipeline-model-parallel-size 12 --num-layers-per-virtual-pipeline-stage 4
  --pipeline-schedule interleaved-1f1b
  --use-distributed-optimizer --overlap-grad-reduce
)
DATA_ARGS=(
  --data-path "$DATA_PATH" --split 949,50,1
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval 100 --log-throughput --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000
  --exit-signal-handler --exit-duration-in-mins 1410
  --eval-interval 1000 --eval-iters 10
)

CMD=(python -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py"
     "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
     "${EVAL_AND_LOGGING_ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
[ -f "$ROOT/.venv/bin/activate" ] && . "$ROOT/.venv/bin/activate"
exec "${CMD[@]}"
