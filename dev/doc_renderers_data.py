"""The figures docs/data.md and README.md quote about the demo corpus, read from docs/results/demo_corpus.json
(written by `python -m megatron_pp.data.demo_corpus runs/demo-data --stats-json docs/results/demo_corpus.json`,
the demo's data step; dev/doc_renderers.py registers them). Each takes the parsed JSON and returns the phrase
that stands between the page's markers; nothing is computed but unit changes.
"""
from __future__ import annotations

from doc_format import num, pct


def _megabytes(n_bytes: int) -> str:
    """Decimal megabytes, as a file listing shows them: 2563563 -> '2.56 MB'."""
    return f"{n_bytes / 1e6:.2f} MB"


def demo_corpus_megabytes(data: dict) -> str:
    """README's size of the corpus: '2.56 MB'."""
    return _megabytes(data["corpus_bytes"])


def demo_corpus_size(data: dict) -> str:
    """'655 documents, 2.56 MB of JSON lines (Python 3.11.7's standard library)'."""
    return (f"{num(data['documents'], 0)} documents, {_megabytes(data['corpus_bytes'])} of JSON lines "
            f"(Python {data['python']}'s standard library)")


def demo_corpus_tokens(data: dict) -> str:
    """The token count, whole and per split of the demo's --split: '706,697 tokens, EOD included; the demo's
    `--split 95,5,0` trains on 674,167 of them in 622 documents and validates on 32,530 in 33'."""
    splits = data["splits"]
    used = [(name, splits[name]) for name in ("train", "valid", "test") if splits[name]]
    verbs = {"train": "trains on", "valid": "validates on", "test": "tests on"}
    parts = [f"{verbs[name]} {num(s['tokens'], 0)} " + ("of them " if i == 0 else "") +
             f"in {num(s['documents'], 0)}" + (" documents" if i == 0 else "") for i, (name, s) in enumerate(used)]
    return (f"{num(data['tokens'], 0)} tokens, EOD included; the demo's `--split {data['split']}` "
            + " and ".join(parts))


# Host load averages that timing JSONs record, rendered where a page names the machine a run was timed on
# (docs/benchmarks.md); a load average no JSON holds is marked in the page as read off the host.

def load_at_start(data: dict) -> str:
    """One reading, taken when the run started: 'load average 14.4 at the start'."""
    return f"load average {num(data['load_average_at_start'], 1)} at the start"


def load_start_to_end(data: dict) -> str:
    """Readings at the start and the end of the run: 'load average 2.4 at the start, 2.6 at the end'."""
    return (f"load average {num(data['load_average_start'], 1)} at the start, "
            f"{num(data['load_average_end'], 1)} at the end")


# docs/planner.md, "Against the dry run": the prose figures of tools/validate_planner.py's full-size comparison
# (docs/results/planner_vs_dry_run_full_size.json; the table above them renders the same rows).

def _rank_row(data: dict, preset: str, configuration_start: str, last: bool) -> dict:
    """The first or last pipeline rank's row of the one result whose preset and configuration match."""
    results = [r for r in data["results"] if r["preset"] == preset and r["configuration"].startswith(configuration_start)]
    if len(results) != 1:
        raise ValueError(f"{len(results)} results for {preset} {configuration_start!r}, expected one")
    ranks = sorted(results[0]["ranks"], key=lambda r: r["pipeline_rank"])
    return ranks[-1] if last else ranks[0]


def planner_backward_working_set(data: dict) -> str:
    """The planner's backward working set on LLaMA-3-70B 1F1B, first and last stage: ('0.32 GiB', '0.39 GiB')
    joined as the sentence has them."""
    first, last = (_rank_row(data, "llama3-70b", "1f1b tp8 pp8 dp1 b=1 recompute=none", end) for end in (False, True))
    return (f"{num(first['predicted_backward_bytes'] / 2**30)} GiB on the first stage, "
            f"{num(last['predicted_backward_bytes'] / 2**30)} GiB on the last")


def planner_high_on_last_rank(data: dict) -> str:
    """How far above the dry run the planner is on the last rank of 1F1B with full recomputation and of
    looped-bfs: '+0.51% and +0.45%'."""
    rows = (_rank_row(data, "llama3-70b", "1f1b tp8 pp8 dp1 b=1 recompute=full", True),
            _rank_row(data, "llama3-70b", "looped-bfs", True))
    return " and ".join(pct(r["predicted_over_measured"] - 1, 2, sign=True) for r in rows)


def planner_po_h_last_rank(data: dict) -> str:
    """PO-H's last rank, planner over dry run less one: '+0.11%'."""
    return pct(_rank_row(data, "llama3-70b", "po-h", True)["predicted_over_measured"] - 1, 2, sign=True)


def plan_best_mfu(data: dict) -> str:
    """docs/planner.md: the MFU of the best-ranked row of the committed plan ('65% in its best row')."""
    return f"{pct(data['ranked'][0]['mfu'], 0)} in its best row"


# docs/reliability.md, "The interaction matrix": the arrays' outcomes and deviations (dev/interaction_matrix.py
# --json) and the step-1 probe of one case (dev/step1_update_probe.py --json).

def sci(value: float, places: int = 1) -> str:
    """'1.8e-7' for 1.831e-07 (no zero-padded exponent)."""
    mantissa, exponent = f"{value:.{places}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _low_precision(dev: dict) -> str:
    return " and ".join(f"{p} within {sci(dev[p]['loss'])} / {sci(dev[p]['grad_norm'])}" for p in ("bf16", "fp16"))


def matrix_default_run(data: dict) -> str:
    """The default array's time and largest deviations from each case's reference."""
    dev = data["largest_relative_deviation_from_reference"]
    update = ("equal to AdamW's of the run's gradients bit for bit" if dev["fp32"]["update"] == 0
              else f"within {sci(dev['fp32']['update'])} of AdamW's of the run's gradients")
    seconds = sum(r["wall_s"] for r in data["results"] if r.get("wall_s") is not None)
    return (f"{num(seconds, 1)} s of case time in all, pool start-ups included; fp32 within "
            f"{sci(dev['fp32']['loss'])} of the loss, {sci(dev['fp32']['grad_norm'])} of the gradient norm and "
            f"{sci(dev['fp32']['gradient'])} on every gradient tensor, every update element {update}; "
            f"{_low_precision(dev)} of their 1F1B runs")


def matrix_outcomes(data: dict) -> str:
    """'122 cases, 119 run, 3 refused, none failed'."""
    failed = "none failed" if data["failed"] == 0 else f"{data['failed']} failed"
    return f"{data['cases']} cases, {data['ran']} run, {data['refused']} refused, {failed}"


def matrix_larger_draw(data: dict) -> str:
    """A larger draw's outcomes and deviations, in the words of the page."""
    dev = data["largest_relative_deviation_from_reference"]
    return (f"{matrix_outcomes(data)}; fp32 within {sci(dev['fp32']['loss'])} / {sci(dev['fp32']['grad_norm'])} / "
            f"{sci(dev['fp32']['gradient'])} (loss, gradient norm, gradient tensors); {_low_precision(dev)} of "
            f"their 1F1B runs (loss / gradient norm)")


def _test_tolerances() -> dict:
    """LOW_PRECISION_TOL of tests/interaction.py, read from its source (its one home; not imported: the
    tests' module loads torch and the worker pool)."""
    import ast
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "interaction.py")
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LOW_PRECISION_TOL" for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError("LOW_PRECISION_TOL not found in tests/interaction.py")


def matrix_low_precision_margin(data: dict) -> str:
    """The default array's bf16/fp16 deviations and how far under the tests' bounds they sit (the smaller of
    bound / deviation over loss and norm, both precisions)."""
    dev, tol = data["largest_relative_deviation_from_reference"], _test_tolerances()
    margin = min(tol[p][k] / dev[p][k] for p in ("bf16", "fp16") for k in ("loss", "grad_norm"))
    return (f"{sci(dev['bf16']['loss'])} / {sci(dev['bf16']['grad_norm'])} (bf16, unit roundoff 3.9e-3) and "
            f"{sci(dev['fp16']['loss'])} / {sci(dev['fp16']['grad_norm'])} (fp16, 4.9e-4), so the bounds are "
            f"{num(margin, 1)}× or more the rounding seen")


def _probe(data: dict) -> dict:
    return data["variants"]["as is"]


def _elements(data: dict) -> list:
    """The probe's listed elements (older probe JSONs hold the list as its Python repr)."""
    import ast
    elements = _probe(data)["elements"]
    return ast.literal_eval(elements) if isinstance(elements, str) else elements


def probe_norm_miss(data: dict) -> str:
    """Step 2's gradient-norm difference against the reference that went on from its own step 1: '3.7e-5'."""
    return sci(_probe(data)["step2_from_the_reference_step1"]["grad_norm_relative"])


def probe_elements(data: dict) -> str:
    """'27 weights differ by more than 1e-4·lr, by up to 3.9e-5'."""
    probe, elements = _probe(data), _elements(data)
    return (f"{probe['elements_over_threshold']} weights differ by more than {sci(probe['threshold_times_lr'], 0)}·lr, "
            f"by up to {sci(max(abs(e['weight_difference']) for e in elements))}")


def probe_gradient_range(data: dict) -> str:
    """The listed elements' step-1 gradients: '6.6e-11 and 1.7e-7'."""
    g = [abs(e["step1_gradient"]) for e in _elements(data)]
    return f"{sci(min(g))} and {sci(max(g))}"


def probe_gradient_difference(data: dict) -> str:
    """The two runs' step-1 gradient difference at the listed elements: '2.0e-12 to 3.1e-10'."""
    d = [abs(e["gradient_difference"]) for e in _elements(data)]
    return f"{sci(min(d))} to {sci(max(d))}"


def probe_model_error(data: dict) -> str:
    """How far the model's predicted weight difference is from the measured one, the worst element: '0.51%'."""
    worst = max(abs(e["model_weight_difference"] / e["weight_difference"] - 1) for e in _elements(data))
    return pct(worst, 2)


def probe_same_without(data: dict) -> str:
    """Whether the dropped flags change the miss: 'the same 3.7e-5, bit for bit' or each variant's value."""
    values = {name: v["step2_from_the_reference_step1"]["grad_norm_relative"] for name, v in data["variants"].items()}
    if len(set(values.values())) == 1:
        return f"the same {sci(next(iter(values.values())))}, bit for bit"
    return "; ".join(f"{name}: {sci(v)}" for name, v in values.items())


def probe_own_weights(data: dict) -> str:
    """Step 2 from the run's own step-1 weights: '5.3e-10'."""
    return sci(_probe(data)["step2_from_the_run_step1"]["grad_norm_relative"])


def matrix_fp32_norm(data: dict) -> str:
    """The largest fp32 gradient-norm deviation over the array: '3.9e-8'."""
    return sci(data["largest_relative_deviation_from_reference"]["fp32"]["grad_norm"])


# docs/schedules.md, BPipe at run time: the p = 8, m = 8 stash table (tools/plot_schedule.py --compare 1f1b,bpipe).

def bpipe_exec_table(runs: list) -> str:
    """Per rank: 1F1B's peak stashes (simulated; the test measures the same), BPipe's simulated peaks, and what
    tests/schedules/test_bpipe_exec.py asserts of the measured run: the simulated count on a rank that hosts no
    guest, at most its own 1F1B stashes plus the guests hosted at once on an acceptor."""
    plain, bpipe = (next(r for r in runs if r["schedule"] == name) for name in ("1f1b", "bpipe"))
    p = bpipe["num_ranks"]
    hosts = {p - 1 - rank for rank, parked in enumerate(bpipe["peak_parked"]) if parked}
    measured = [f"≤ {plain['peak_stash'][rank]} + hosted" if rank in hosts else str(bpipe["peak_stash"][rank])
                for rank in range(p)]
    rows = [["`1f1b` peak stashes (simulated = measured)", *map(str, plain["peak_stash"])],
            ["`bpipe` peak stashes, simulated", *map(str, bpipe["peak_stash"])],
            ["`bpipe` measured (what the test asserts)", *measured]]
    return "\n".join(["| rank | " + " | ".join(map(str, range(p))) + " |", "|---|" + "---|" * p]
                     + ["| " + " | ".join(row) + " |" for row in rows])
