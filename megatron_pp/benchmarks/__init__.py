"""Benchmark harnesses: paired schedule timing, MFU, the torch.distributed.pipelining comparison and the soak test."""
