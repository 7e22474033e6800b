"""Exceptions with messages a user can act on.

Each error the engine raises for bad input or a bad installation derives from `PegainferError`,
so the server can map them to HTTP statuses without catching unrelated bugs.
"""


class PegainferError(Exception):
    """Base class for the errors pegainfer raises on purpose."""


class ConfigError(PegainferError, ValueError):
    """An engine argument is invalid or inconsistent with the model."""


class ModelLineError(PegainferError):
    """No installed model line claims a checkpoint, or more than one does."""


class WeightLoadError(PegainferError):
    """A checkpoint file or tensor is missing, malformed or of the wrong shape."""


class InvalidRequestError(PegainferError, ValueError):
    """A request cannot be served as asked (bad sampling value, prompt too long, ...).

    `param` names the offending request field, as OpenAI's error bodies do.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
