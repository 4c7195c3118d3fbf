"""What the benchmarks share: an HTTP/1.1 client (http), a `holoserve serve` child process (server), and the
writers of a run's record, table and plot plus the machine description (report)."""
