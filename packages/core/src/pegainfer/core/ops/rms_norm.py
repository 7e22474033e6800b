"""RMSNorm as Qwen3 and Llama define it, and the zero-centred form of Qwen3.5 (and Gemma)."""

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False
) -> torch.Tensor:
    """Normalise in float32, cast back to the input dtype, then scale (HF's order of casts).

    `zero_centred`: the weight is stored as w - 1 and the scaling by `1 + w` happens in
    float32 before the one cast back (transformers' `Qwen3_5RMSNorm`).
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x; return rms_norm(residual), residual` (the pre-norm block's entry).

    With `residual` None (the first layer) the input itself becomes the residual.
    """
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps, zero_centred), residual
