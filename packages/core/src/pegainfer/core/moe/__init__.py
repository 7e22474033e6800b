"""Mixture of experts shared by the lines that route tokens to experts (DeepSeek-V2/V3,
Kimi-K2, GLM-5): routing, the experts' weights and their fused Triton kernels, the layer."""
