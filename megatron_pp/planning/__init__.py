"""Planning: closed-form memory of a pipeline stage, per-layer efficiency curves, and the BPipe estimator.

Nothing here builds a model or runs a step. `memory` says how many bytes a stage holds (activations per
microbatch, weights, gradients and optimizer state), `efficiency` says how long a layer's forward and
backward take at a microbatch size (measured by `tools/bench_layer.py`, or a documented roofline), and
`bpipe_estimator` combines them with the schedule simulator to answer "should I turn BPipe on for this
job?" (docs/bpipe.md).
"""
