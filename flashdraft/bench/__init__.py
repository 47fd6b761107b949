"""Measuring: the benchmark against plain decoding and other methods, and offline acceptance (tau)."""
