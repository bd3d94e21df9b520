"""Test data: the flags and values that two of Megatron-LM's example launch scripts pass to its
`pretrain_gpt.py`, written out by hand as argument lists (the scripts themselves are not copied).

LLAMA3_8B_BF16 is `examples/llama/train_llama3_8b_h100_fp8.sh` with DTYPE=bf16 (its fp8 block left
out) and mock data; FP8_BLOCK is that fp8 block, which needs TransformerEngine. GPT3_175B is
`examples/gpt3/train_gpt3_175b_distributed.sh`. Paths are placeholders (CKPT, TB, DATA, VOCAB, MERGE)
that a test replaces with its own directories and files. The llama script quotes its split as
"'99,1,0'"; bash keeps those quotes in an unquoted array expansion, a quirk we leave out here.
"""

LLAMA3_8B_BF16 = [
    # model
    "--use-mcore-models",
    "--num-layers", "32",
    "--hidden-size", "4096",
    "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32",
    "--group-query-attention",
    "--num-query-groups", "8",
    "--kv-channels", "128",
    "--seq-length", "8192",
    "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope",
    "--rotary-base", "1000000",
    "--rotary-percent", "1.0",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--swiglu",
    "--init-method-std", "0.0134",
    "--attention-backend", "fused",
    "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    # training
    "--micro-batch-size", "1",
    "--global-batch-size", "128",
    "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748",
    "--lr-warmup-samples", "3906252",
    "--lr", "0.00015",
    "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine",
    "--clip-grad", "1.0",
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--bf16",
    "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss",
    "--manual-gc",
    "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    # model parallelism
    "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1",
    "--sequence-parallel",
    # data (mock)
    "--mock-data",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128256",
    "--data-cache-path", "CACHE",
    "--tiktoken-pattern", "v2",
    "--split", "99,1,0",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--num-workers", "1",
    # evaluation and logging
    "--log-interval", "1",
    "--eval-iters", "32",
    "--eval-interval", "100",
    "--save-interval", "1000",
    "--log-throughput",
    "--profile",
    "--profile-step-start", "4",
    "--profile-step-end", "6",
    "--ckpt-format", "torch_dist",
    "--distributed-timeout-minutes", "60",
    "--save", "CKPT",
    "--load", "CKPT",
    "--tensorboard-dir", "TB",
]

FP8_BLOCK = [
    "--fp8-format", "hybrid",
    "--fp8-amax-history-len", "1024",
    "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather",
]

GPT3_175B = [
    # model
    "--num-layers", "96",
    "--hidden-size", "12288",
    "--num-attention-heads", "96",
    "--seq-length", "2048",
    "--max-position-embeddings", "2048",
    "--attention-backend", "auto",
    # training
    "--micro-batch-size", "1",
    "--global-batch-size", "1536",
    "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "500000",
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--init-method-std", "0.006",
    "--clip-grad", "1.0",
    "--fp16",
    "--lr", "6.0e-5",
    "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000",
    # model parallelism
    "--tensor-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "16",
    # data
    "--data-path", "DATA",
    "--vocab-file", "VOCAB",
    "--merge-file", "MERGE",
    "--split", "949,50,1",
    # evaluation and logging
    "--log-interval", "100",
    "--save-interval", "10000",
    "--eval-interval", "1000",
    "--save", "CKPT",
    "--load", "CKPT",
    "--eval-iters", "10",
    "--tensorboard-dir", "TB",
]
