"""dev/doc_renderers_data.py on small made-up JSON: the demo corpus's sentence names every split that has
documents, a row selection matching no result (or two) fails by name, numbers in scientific notation carry no
padded exponent, and a figure whose JSON says something other than the usual case says that instead."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev"))

import doc_renderers_data as data_docs  # noqa: E402


def corpus(splits):
    return {"documents": 10, "corpus_bytes": 2_500_000, "tokens": 1000, "python": "3.11.7", "split": "8,1,1",
            "splits": splits}


def test_demo_corpus_sentence_names_each_split_with_documents():
    three = corpus({"train": {"documents": 8, "tokens": 800}, "valid": {"documents": 1, "tokens": 100},
                    "test": {"documents": 1, "tokens": 100}})
    assert data_docs.demo_corpus_tokens(three) == ("1,000 tokens, EOD included; the demo's `--split 8,1,1` trains on "
                                                   "800 of them in 8 documents and validates on 100 in 1 and tests on "
                                                   "100 in 1")
    two = corpus({"train": {"documents": 9, "tokens": 900}, "valid": {"documents": 1, "tokens": 100}, "test": None})
    assert "tests on" not in data_docs.demo_corpus_tokens(two)
    assert data_docs.demo_corpus_size(two) == "10 documents, 2.50 MB of JSON lines (Python 3.11.7's standard library)"


def test_a_rank_row_selection_must_match_exactly_one_result():
    result = {"preset": "llama3-70b", "configuration": "po-h v=2", "ranks": [
        {"pipeline_rank": 7, "predicted_over_measured": 1.0011}, {"pipeline_rank": 0, "predicted_over_measured": 0.9}]}
    assert data_docs.planner_po_h_last_rank({"results": [result]}) == "+0.11%"
    with pytest.raises(ValueError, match="2 results"):
        data_docs.planner_po_h_last_rank({"results": [result, result]})
    with pytest.raises(ValueError, match="0 results"):
        data_docs.planner_po_h_last_rank({"results": []})


def test_scientific_notation_and_what_a_non_zero_update_or_a_differing_variant_says():
    assert data_docs.sci(1.831e-07) == "1.8e-7" and data_docs.sci(3.1e-10) == "3.1e-10" and data_docs.sci(1e-4, 0) == "1e-4"
    dev = {"fp32": {"loss": 1e-7, "grad_norm": 2e-8, "gradient": 3e-7, "update": 4e-9},
           "bf16": {"loss": 1e-4, "grad_norm": 1e-3}, "fp16": {"loss": 1e-6, "grad_norm": 1e-4}}
    text = data_docs.matrix_default_run({"largest_relative_deviation_from_reference": dev,
                                         "results": [{"wall_s": 1.2}, {"wall_s": None}, {"wall_s": 2.0}]})
    assert text.startswith("3.2 s of case time") and "within 4.0e-9 of AdamW's" in text and "bit for bit" not in text
    variants = {"as is": {"step2_from_the_reference_step1": {"grad_norm_relative": 3.7e-5}},
                "without X": {"step2_from_the_reference_step1": {"grad_norm_relative": 1.0e-6}}}
    assert data_docs.probe_same_without({"variants": variants}) == "as is: 3.7e-5; without X: 1.0e-6"
