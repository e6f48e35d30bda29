"""Benchmark tests and committed results; the harness itself is :mod:`cbverify.bench`."""
