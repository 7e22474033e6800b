"""The KV side: block ids and the prefix cache, the cache tensors (arenas, state slots), recurrent-
state checkpoints and the host-memory tier."""
