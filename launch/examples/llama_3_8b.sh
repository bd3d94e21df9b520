#!/usr/bin/env bash
# LLaMA-3 8B (32 layers, hidden 4096, 32 query heads in 8 key/value groups, SwiGLU 14336, RoPE base
# 500000, 8192 tokens) in the shape of a Megatron-LM launch script: the same flag names, grouped the same
# way. Run it on every node (torchrun per node; under SLURM, `srun --ntasks-per-node 1 bash
# launch/examples/llama_3_8b.sh` with NODE_RANK from SLURM_NODEID). 4 nodes x 8 GPUs = 32 GPUs: tensor
# parallel 2, 4 pipeline stages with 2 interleaved chunks of 4 layers each, data parallel 4.
#
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama3/tokenizer.json \
#   CHECKPOINT_PATH=/ckpt/llama3-8b MASTER_ADDR=node001 NODE_RANK=0 bash launch/examples/llama_3_8b.sh
#   DRY_RUN=1 bash launch/examples/llama_3_8b.sh   # print the command only
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/llama3-8b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:-$ROOT/data/corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$ROOT/data/llama3-tokenizer.json}

DISTRIBUTED_ARGS=(
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
LLAMA_MODEL_ARGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8
  --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 500000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --init-method-std 0.02 --use-flash-attn
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 256 --train-iters 250000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --bf16
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel
  --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4
  --pipeline-schedule interleaved-1f1b
  --use-distributed-optimizer --overlap-grad-reduce
)
DATA_ARGS=(
  --data-path "$DATA_PATH" --split 99,1,0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval 10 --log-throughput --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 500
  --exit-signal-handler --exit-duration-in-mins 230
  --eval-interval 500 --eval-iters 20
)

CMD=(python -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_llama.py"
     "${LLAMA_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
     "${EVAL_AND_LOGGING_ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
[ -f "$ROOT/.venv/bin/activate" ] && . "$ROOT/.venv/bin/activate"
exec "${CMD[@]}"
