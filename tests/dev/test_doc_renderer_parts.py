"""The selection rules of the renderers behind docs/bpipe.md's estimator tables and docs/reproduction.md's
rows (dev/doc_renderers_bpipe.py, dev/doc_renderers_glance.py), on small made-up JSON: which layout's
configuration a re-tuned cell names, which rows merge, which rows a paragraph quotes, and that a selection
matching nothing fails by name instead of rendering an empty figure."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev"))

import doc_renderers_bpipe as bp  # noqa: E402  (before the registry: the modules import in any order)
import doc_renderers_glance as glance  # noqa: E402
import render_docs  # noqa: E402


def config(b, recompute, step, K=4, transfer=0.0):
    return {"micro_batch_size": b, "recompute": recompute, "resident_bound": K, "step_s": step,
            "transfer_overhead_s": transfer, "stage_peak_bytes": [2**30, 2**31]}


def report(tp, pp, dp, plain, bpipe):
    speedup = plain["step_s"] / bpipe["step_s"] if plain and bpipe else None
    return {"job": {"tp": tp, "pp": pp, "dp": dp}, "best_plain": plain, "best_bpipe": bpipe, "speedup": speedup}


def test_retuned_names_each_sides_fastest_layout_and_the_ratio_of_their_steps():
    runs = [report(4, 6, 2, config(1, "full", 24.0), config(1, "full", 24.0, K=5)),
            report(4, 12, 1, config(1, "full", 25.0), config(1, "none", 18.0, K=8))]
    assert bp.retuned(runs) == ("(4,6,2): b=1 full, 24.00 s", "(4,12,1): b=1 none K=8, 18.00 s", "1.33")
    assert bp.best_one_layout(runs) == "1.39 at (4,12,1): b=1 none K=8 against b=1 full"


def test_retuned_says_same_for_1f1bs_own_configuration_and_shows_any_wait():
    runs = [report(4, 6, 2, config(1, "none", 17.0), config(1, "none", 17.2, K=5, transfer=0.2))]
    plain, bpipe, speedup = bp.retuned(runs)
    assert bpipe == "same, K=5, 17.20 s (0.20 s waiting for transfers)" and speedup == "0.99"
    assert bp.best_one_layout(runs) == "0.99 (one layout: (4,6,2))"


def test_nothing_fitting_is_said_not_divided():
    runs = [report(1, 8, 1, None, config(1, "none", 10.0))]
    assert bp.retuned(runs) == ("nothing fits", "(1,8,1): b=1 none K=4, 10.00 s", "only BPipe fits")


def test_rows_merge_only_where_every_other_cell_agrees():
    rows = [["96B", "classic", "ib", "1.00"], ["96B", "classic", "node", "1.00"], ["96B", "modern", "ib", "1.29"],
            ["96B", "modern", "node", "1.32"]]
    assert bp._merge(rows, 2, "either") == [["96B", "classic", "either", "1.00"], ["96B", "modern", "ib", "1.29"],
                                           ["96B", "modern", "node", "1.32"]]


PAPER = {"reports": [{"paper": "toy", "rows": [
    {"claim": "A 1B: speedup", "published": "2×", "predicted": "1.50× (bubble 10%)", "error": -0.25},
    {"claim": "A 2B: speedup", "published": "2×", "predicted": "1.80×", "error": -0.1},
    {"claim": "memory", "published": "4 GB", "predicted": "5.0 GB", "error": None}]}]}


def test_groups_quote_each_row_with_its_tag_and_error_or_the_range():
    each = glance.Group("speedups:", r"A (?P<tag>\S+): speedup")
    span = glance.Group("speedups:", r"speedup", "span", figure=r"^([0-9.]+×)")
    errors = glance.Group("errors:", r"speedup", "errors")
    (toy,) = PAPER["reports"]
    assert glance.group_text(toy, each) == "speedups: 1.50× (1B, −25%), 1.80× (2B, −10%)"
    assert glance.group_text(toy, span) == "speedups: 1.50× to 1.80× (−25% to −10%)"
    assert glance.group_text(toy, errors) == "errors: −25% to −10%"


def test_rows_text_formats_every_matching_row_and_refuses_a_selection_that_matches_none():
    quote = glance.rows_text("toy", r"A (?P<tag>\S+): speedup", "{tag} {predicted} vs {published} ({error})", "; ")
    assert quote(PAPER) == "1B 1.50× (bubble 10%) vs 2× (−25%); 2B 1.80× vs 2× (−10%)"
    assert glance.rows_text("toy", r"^memory$", "{predicted}, error {error}")(PAPER) == "5.0 GB, error —"
    with pytest.raises(ValueError, match="no row's claim matches"):
        glance.rows_text("toy", r"^throughput")(PAPER)


def test_a_renderer_whose_rows_are_gone_is_one_named_problem(monkeypatch):
    """render_docs turns the ValueError above into a line naming page, line and renderer (never a traceback)."""
    monkeypatch.setitem(render_docs.RENDERERS, "toy-quote",
                        ("docs/results/reproduce_full.json", glance.rows_text("bpipe", r"^no such claim")))
    text = ("x <!-- render: toy-quote (from docs/results/reproduce_full.json; do not edit by hand) -->1.00×"
            "<!-- end render: toy-quote --> y")
    _, differences, problems = render_docs.render_page(text, "docs/toy.md", ROOT)
    assert differences == [] and len(problems) == 1
    assert problems[0].startswith("docs/toy.md:1: render toy-quote: cannot render") and "no row's claim" in problems[0]


def test_crowding_bins_take_the_weighted_median_of_their_counts_medians():
    """docs/schedules.md's crowding table (dev/doc_renderers_emulate.py): per bin of compute actions ended
    before a send, the inputs and the median of the per-count medians weighted by their inputs. Bin 3-4 holds
    count 3 (10 inputs, 0.2 ms) and count 4 (30 inputs, 0.6 ms): 40 inputs, and the 20th falls in count 4's."""
    import doc_renderers_emulate as emulate

    def block(counts):
        return {"latency_ms_by_recent_ends": counts}
    blocks = {"1f1b/equal": block({"3": [10, 0.2], "4": [30, 0.6]}), "zb-v/equal": block({"1": [5, 0.1]}),
              "v-half/equal": block({"13": [2, 1.5], "20": [1, 0.9]})}
    reports = ({"rows": [], "list_calibrations": {"16": blocks}},)
    lines = emulate.emulate_crowding_table(*reports).splitlines()
    assert "(p = 16)" in lines[0]
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["3–4"][0] == "40 · 0.60" and cells["0–2"][1] == "5 · 0.10"
    assert cells["13 or more"][2].rstrip(" |") == "3 · 1.50" and cells["5–6"][0] == "–"


def test_list_calibration_cells_show_a_negative_median_as_zero():
    """A median latency below 0 is timing noise, which the simulation takes as 0: the table shows it so."""
    import doc_renderers_emulate as emulate

    block = {"p2p_latency_ms": -0.004, "p2p_latency_mean_ms": 0.03, "host_compute_ms": 0.09, "host_post_ms": 0.15,
             "overrun_ms_p90": 0.06}
    text = emulate.emulate_list_calibration_table({"rows": [], "list_calibrations": {"4": {"zb-h2/split": block}}})
    assert "| zb-h2 | split | 0.00 · 0.03 (0.09 + 0.15; 0.06) |" in text
