"""Hostile-client load test of the HTTP server: `python -m bench.hostile.run`."""
