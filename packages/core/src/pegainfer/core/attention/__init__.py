"""Attention backends: paged GQA and MLA (latent), each a torch reference and a FlashInfer
implementation."""
