"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from pegainfer.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to return to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        info = ErrorInfo(
            self.message, _TYPES.get(self.status, "server_error"), self.param, self.code
        )
        return msgspec.json.encode(ErrorResponse(info))

    def response(self) -> Response:
        return Response(
            self.body(), self.status, headers=self.headers, media_type="application/json"
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")
