"""HoloServe's benchmarks: run each one as a module from the repository root, e.g.
`python -m bench.cpu_latency.run CHECKPOINT` (not installed with the package)."""
