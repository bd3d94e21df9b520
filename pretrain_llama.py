"""Pretrain a LLaMA style model (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output).

    python pretrain_llama.py --model-preset llama-tiny --mock-data --train-iters 20
    torchrun --nproc-per-node 4 pretrain_llama.py --model-preset llama-tiny --mock-data \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8

Flags follow Megatron-LM's names; see `python pretrain_llama.py --help` and README.md.
"""
import sys

from megatron_pp.training.train import main

if __name__ == "__main__":
    main(sys.argv[1:], description=__doc__.splitlines()[0], default_preset="llama-tiny")
