"""Decoding: the engine (one `step()` for plain and speculative decoding, batch 1 and N), rows, sampling and
verification, draft trees, proposers, adaptive speculation."""
