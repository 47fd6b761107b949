"""Decoding: the engine (one `step()` for plain and speculative decoding, batch 1 and N), rows, slots, sampling and verification, proposers, adaptive speculation."""
