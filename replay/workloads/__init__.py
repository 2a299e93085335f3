"""Reference workloads that `replay` records and re-runs; the core names them only by strings."""
