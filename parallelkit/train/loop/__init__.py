"""The training loop every rank runs, the checks made before it starts, and what rank 0 shows
and records of it (log lines, metrics, curves)."""
