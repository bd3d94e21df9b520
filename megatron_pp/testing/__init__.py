"""Test support that tools and development aids use too: the interaction matrix's cases (`interaction`)."""
