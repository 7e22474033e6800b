"""`pegainfer-bench`: benchmarks of pegainfer and the checkpoints they run on."""
