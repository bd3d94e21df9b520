"""Why a correct fp32 run can miss an independent single-process run's step 2: its step-1 update, element by element.

Runs one interaction-matrix case (tests/interaction.py's `run_job`: every gradient and every weight, whole) and a
single-process reference that goes on from its own step 1 (`reference_step` + `adamw_steps`), then lists the
weights after step 1 that differ by more than `--threshold` x lr, with both step-1 gradients there. Adam's first
step moves an element by lr x g / (|g| + eps) (bias-corrected moments of one gradient), whose slope is
lr x eps / (|g| + eps)^2: 1e6 at g = 0 for lr 1e-2, eps 1e-8. Our model of the difference, written down before
comparing: dw = lr x eps x dg / (|g| + eps)^2 at each listed element, dg the two runs' gradient difference there
(summation order). `--drop FLAG` reruns without a flag (e.g. the distributed optimizer, offload) to see whether
it matters. Also given: step 2 from the run's own weights (what the matrix now compares).

    python dev/step1_update_probe.py fp32-gis-tp1pp4dp1v2-rc:none-off:chunks-zero1-untied-mha-llama-tiny \\
        --drop=--use-distributed-optimizer --drop=--offload-chunks --json docs/results/interaction_step1_update.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUED = ("--offload-chunks", "--offload-fraction")


def without(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + (2 if flag in VALUED else 1):]


def probe(run_distributed, argv: list[str], world: int, threshold: float) -> dict:
    """One run against the reference that goes on from its own step 1 (see the module docstring)."""
    from tests.interaction import adamw_steps, merged, reference_step, run_job

    results = run_distributed(world, run_job, argv, True)
    rows = results[0]["rows"]
    lr = rows[0][3]
    eps = float(argv[argv.index("--adam-eps") + 1]) if "--adam-eps" in argv else 1e-8
    loss1, norm1, g_ref, w0 = reference_step(argv, 0)
    w1_ref = adamw_steps(argv, w0, [g_ref], [norm1], [lr])[0]
    loss2, norm2, _, _ = reference_step(argv, 1, w1_ref)
    own_loss2, own_norm2, _, _ = reference_step(argv, 1, merged(results, "weights", 1))
    g_run, w1 = merged(results, "grads", 0), merged(results, "weights", 1)
    scale = min(1.0, 1.0 / (norm1 + 1e-6))  # --clip-grad 1.0, as the matrix runs
    elements = []
    for name in sorted(w1):
        diff = (w1[name] - w1_ref[name]).flatten()
        for i in (diff.abs() > threshold * lr).nonzero().flatten().tolist():
            g, dg = float(g_ref[name].flatten()[i]) * scale, float((g_run[name] - g_ref[name]).flatten()[i]) * scale
            elements.append({"parameter": name, "index": i, "weight_difference": float(diff[i]),
                             "step1_gradient": g, "gradient_difference": dg,
                             "model_weight_difference": -lr * eps * dg / (abs(g) + eps) ** 2})
    every = [abs(float(x)) for name in g_ref for x in (g_ref[name].flatten() * scale)]
    return {
        "argv": argv, "lr": lr, "adam_eps": eps,
        "step1": {"loss": [rows[0][0], loss1], "grad_norm": [rows[0][1], norm1]},
        "step2_from_the_reference_step1": {"loss": [rows[1][0], loss2], "grad_norm": [rows[1][1], norm2],
                                           "grad_norm_relative": abs(rows[1][1] - norm2) / norm2},
        "step2_from_the_run_step1": {"loss": [rows[1][0], own_loss2], "grad_norm": [rows[1][1], own_norm2],
                                     "grad_norm_relative": abs(rows[1][1] - own_norm2) / own_norm2},
        "elements_over_threshold": len(elements), "threshold_times_lr": threshold,
        "nonzero_step1_gradients_below": {f"{t:.0e}": sum(0 < g < t for g in every) for t in (1e-9, 1e-8, 1e-7)},
        "elements": elements,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help="a case name of the default array (dev/interaction_matrix.py --list)")
    parser.add_argument("--drop", action="append", default=[], metavar="FLAG",
                        help="also run without this flag of the case (repeatable: each alone, then all)")
    parser.add_argument("--threshold", type=float, default=1e-4, help="list weights off by more than this x lr")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, ROOT)
    import torch

    from megatron_pp.cli import write_json
    from megatron_pp.testing import interaction
    from tests.dist import run_distributed, shutdown_pools

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="step1-probe-")
    cases = {interaction.case_name(c): c for c in interaction.covering_array(accepts=interaction.accepted(workdir))}
    if args.case not in cases:
        parser.error(f"case {args.case!r} is not in the default array (see dev/interaction_matrix.py --list)")
    job = interaction.make_job(cases[args.case], workdir)
    base = list(job.argv)
    missing = [f for f in args.drop if f not in base]
    if missing:
        parser.error(f"--drop {missing[0]}: the case does not pass it")
    variants = {"as is": base}
    for flag in args.drop:
        variants[f"without {flag}"] = without(base, flag)
    if len(args.drop) > 1:
        reduced = base
        for flag in args.drop:
            reduced = without(reduced, flag)
        variants["without " + " ".join(args.drop)] = reduced
    report = {"case": args.case, "command": "python dev/step1_update_probe.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "variants": {}}
    try:
        for label, variant in variants.items():
            out = report["variants"][label] = probe(run_distributed, variant, job.world, args.threshold)
            print(f"{label}: step 2 norm {out['step2_from_the_reference_step1']['grad_norm_relative']:.2e} off the "
                  f"reference's own step 2, {out['step2_from_the_run_step1']['grad_norm_relative']:.2e} off step 2 "
                  f"from the run's weights; {out['elements_over_threshold']} weights off by > "
                  f"{args.threshold:g} lr after step 1", flush=True)
    finally:
        shutdown_pools()
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
