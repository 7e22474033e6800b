"""Entry point: registers the DeepSeek line with pegainfer's plugin manager."""

from pegainfer.core.model_line import ModelLine
from pegainfer.core.plugins import hookimpl


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    from pegainfer.models.deepseek.line import DeepseekLine

    return [DeepseekLine()]
