"""The seed papers' reproductions, one module per paper (its full-scale rows and small-scale trends), with
what they share in `common` and the small-scale harness in `small`; `planning.reproduce` dispatches."""
