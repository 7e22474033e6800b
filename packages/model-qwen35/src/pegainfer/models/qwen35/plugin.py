"""Entry point: registers the Qwen3.5 line with pegainfer's plugin manager."""

from pegainfer.core.model_line import ModelLine
from pegainfer.core.plugins import hookimpl


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    from pegainfer.models.qwen35.line import Qwen35Line

    return [Qwen35Line()]
