"""Speculative decoding: drafters propose tokens, a verify step of 1 + k tokens per request
checks them against the target model and accepts a variable number (`--speculative-tokens`)."""
