"""Packaging for megatron_pp.

torch is required but deliberately loose (>= 2.11): GPU clusters often carry an older build than CI,
and pip must never replace a site's CUDA torch with a different one.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_pp",
    version="0.1.0",
    description="Megatron-style LLM pretraining with memory-efficient pipeline parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_pp", "megatron_pp.*"]),
    install_requires=[
        "torch>=2.11",
        "numpy",
        "pyyaml",
        "transformers",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "wandb",
        "tensorboard",
        "matplotlib",
        "tqdm",
        "zstandard",
    ],
    extras_require={
        "gpu": ["flash-attn"],
        # megatron-core (the checkpoint conversion tests run its GPTModel) is installed by launch/setup.sh
        # with --no-deps, pinned, so pip never touches the torch build; psutil is what its checkpoint writer needs.
        "dev": ["pytest", "hypothesis", "psutil"],
    },
)
