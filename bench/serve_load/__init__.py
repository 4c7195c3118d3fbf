"""HTTP serving load benchmark: `python -m bench.serve_load.run`."""
