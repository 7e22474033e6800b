"""Entry point: registers the GLM-5 line with pegainfer's plugin manager."""

from pegainfer.core.model_line import ModelLine
from pegainfer.core.plugins import hookimpl


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    from pegainfer.models.glm5.line import Glm5Line

    return [Glm5Line()]
