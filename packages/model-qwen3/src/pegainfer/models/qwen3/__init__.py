"""The Qwen3 model line (dense GQA with per-head q/k norms): Qwen3-0.6B to 32B, 4B and 8B first."""
