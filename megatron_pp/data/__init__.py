"""Datasets and tokenizers."""
