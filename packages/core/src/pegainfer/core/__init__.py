"""What every model line shares: plugins, engine, KV blocks, scheduling, sampling, loading."""
