"""HTTP errors answered with OpenAI's error body: {"error": {message, type, param, code}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class HTTPError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param=None,
        code=None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: HTTPError) -> JSONResponse:
    return JSONResponse(
        error_body(str(exc), exc.type, exc.param, exc.code), exc.status, headers=exc.headers
    )
