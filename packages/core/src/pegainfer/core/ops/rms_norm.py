"""RMSNorm as Qwen3 and Llama define it."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back to the input dtype, then scale (HF's order of casts)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x; return rms_norm(residual), residual` (the pre-norm block's entry).

    With `residual` None (the first layer) the input itself becomes the residual.
    """
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps), residual
