"""Accuracy benchmarks: `python -m bench.accuracy.run` and its side studies."""
