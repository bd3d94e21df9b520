"""Pretrain a GPT-3 style model (learned positions, LayerNorm, GELU, tied embeddings).

    python pretrain_gpt.py --model-preset gpt-tiny --mock-data --train-iters 20
    torchrun --nproc-per-node 4 pretrain_gpt.py --model-preset gpt-tiny --mock-data \
        --pipeline-model-parallel-size 4 --pipeline-schedule 1f1b --global-batch-size 8

Flags follow Megatron-LM's names; see `python pretrain_gpt.py --help` and README.md.
"""
import sys

from megatron_pp.training.train import main

if __name__ == "__main__":
    main(sys.argv[1:], description=__doc__.splitlines()[0], default_preset="gpt-tiny")
