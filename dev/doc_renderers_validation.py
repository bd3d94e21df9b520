"""The figures docs/planner.md's "Accuracy on CPU" prose quotes from `tools/validate_planner.py`'s JSON
(docs/results/planner_validation.json): the range of step-time errors, how far one configuration's
iterations spread, the largest stash error, and how the planner's inputs drifted over the run
(dev/doc_renderers.py registers them). Errors are predicted / measured − 1, as in the table beside them.
"""
from __future__ import annotations


def _signed(value: float, places: int = 0) -> str:
    return f"{value * 100:+.{places}f}%".replace("-", "−")


def _timed(data: dict) -> list[dict]:
    return [row for row in data["rows"] if row["measured_step_s"] is not None]


def step_error_range(data: dict) -> str:
    """'−40% to +211%' over the timed rows."""
    errors = [row["predicted_step_s"] / row["measured_step_s"] - 1 for row in _timed(data)]
    return f"{_signed(min(errors))} to {_signed(max(errors))}"


def step_error_worst(data: dict) -> str:
    """The largest step-time error over the timed rows, signed: '+211%'."""
    errors = [row["predicted_step_s"] / row["measured_step_s"] - 1 for row in _timed(data)]
    return _signed(max(errors, key=abs))


def iteration_spread(data: dict) -> str:
    """How far one configuration's iterations ranged, slowest over fastest, lowest to highest: '2× to 6×'."""
    spreads = [high / low for low, high in (row["measured_step_s_range"] for row in _timed(data))]
    return f"{min(spreads):.0f}× to {max(spreads):.0f}×"


def _stash_errors(data: dict) -> list[float]:
    return [p / m - 1 for row in data["rows"] for p, m in zip(row["predicted_stash_bytes"], row["measured_stash_bytes"])]


def stash_error_largest(data: dict) -> str:
    """The largest stash error in size over every configuration and rank: '0.34%'."""
    return f"{max(abs(e) for e in _stash_errors(data)) * 100:.2f}%"


def hosted_rank_margin(data: dict) -> str:
    """How far below the planner's bound BPipe's hosting rank measured ('0.21%'): the bpipe row's largest
    positive stash error (predicted above measured)."""
    (row,) = [row for row in data["rows"] if row["configuration"].startswith("bpipe")]
    worst = max(p / m - 1 for p, m in zip(row["predicted_stash_bytes"], row["measured_stash_bytes"]))
    return f"{worst * 100:.2f}%"


def input_drift(data: dict) -> str:
    """The planner's inputs measured after the runs against before: '+38% (matrix-product rate), ...'."""
    names = {"gemm_tflops": "matrix-product rate", "copy_gbps": "copy", "p2p_gbps": "p2p",
             "collective_latency_s": "collective latency"}
    drift = data["profile_drift"]
    parts = [f"{_signed(drift[key])} ({label})" for key, label in names.items()]
    return ", ".join(parts[:-1]) + f" and {parts[-1]}"
