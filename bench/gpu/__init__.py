"""The GPU benchmark, shipped to a GPU machine and run there from the repository root: `python3 -m bench.gpu.run`."""
