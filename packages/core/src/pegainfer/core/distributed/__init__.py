"""Parallelism: sharded layers, tensor-parallel and data-parallel ranks, the expert exchange."""
