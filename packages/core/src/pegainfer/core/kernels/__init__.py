"""Triton kernels shared by model lines (CUDA only; each mirrors a reference in `core.ops`)."""
