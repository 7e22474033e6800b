"""The decoder DeepSeek-V2/V3, Kimi-K2 and GLM-5 share: multi-head latent attention over a
paged latent cache, then a dense SwiGLU MLP (the first `first_k_dense_replace` layers) or a MoE
of routed and shared experts. Each line parses its checkpoints' config into
`LatentMoEConfig`, claims its model types and builds `LatentMoEForCausalLM` (or extends it)."""
