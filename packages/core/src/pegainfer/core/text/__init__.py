"""Tokenizers and incremental detokenization."""
