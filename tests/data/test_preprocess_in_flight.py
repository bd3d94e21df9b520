"""Preprocessing on worker processes reads ahead a bounded number of chunks (megatron_pp/data/preprocess.py,
`_ordered_results`: at most 4 chunks per worker in flight), so a corpus of any size tokenizes in bounded memory.

tests/data/test_tools.py checks the bytes written (the same for 1, 2 or 3 workers, in input order); reading the
whole input ahead before yielding anything (issue 37's seed-44 mutation survivor, the in-loop yield dropped)
writes the same bytes and holds the whole corpus in memory. Here the chunks come from a generator that counts
how many were taken before the first result came back."""
import json

from megatron_pp.data.preprocess import _ordered_results

WORKERS, CHUNKS = 2, 40


def test_workers_take_at_most_four_chunks_each_ahead_of_the_first_result():
    taken = []

    def chunks():
        for c in range(CHUNKS):
            taken.append(c)
            yield [(c, json.dumps({"text": f"{c} {c + 1}"}).encode())]

    results = _ordered_results(chunks(), WORKERS, ({"tokenizer_type": "NullTokenizer", "vocab_size": 100},
                                                   ("text",), False))
    first = next(results)
    ahead = len(taken)
    rest = list(results)
    assert ahead <= 4 * WORKERS + 1 < CHUNKS  # the chunk whose submission reached the bound, then one result
    assert [r[0][0] for r in [first, *rest]] == list(range(CHUNKS))  # every chunk, in input order
    assert first[0][1][0].tolist() == [0, 1]
