"""CPU latency benchmarks: `python -m bench.cpu_latency.run` and its A/B scripts."""
