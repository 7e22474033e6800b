"""Checkpoints: finding the files, loading the weights, generation defaults."""
