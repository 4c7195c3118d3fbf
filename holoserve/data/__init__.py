"""Tasks, labelled rows and metrics (torch-free): what compress, eval, export and the benchmarks score."""
