"""Entry point: registers the Kimi-K2 line with pegainfer's plugin manager."""

from pegainfer.core.model_line import ModelLine
from pegainfer.core.plugins import hookimpl


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    from pegainfer.models.kimi_k2.line import KimiK2Line

    return [KimiK2Line()]
