"""HTTP errors answered with OpenAI's error body: {"error": {message, type, param, code}}.

Every failure a route can meet ends here: request validation (400 naming the field, never
FastAPI's 422), bad values (400), unknown paths and methods (404/405), and bugs (500).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mci.errors import InvalidParameter, UserError, error_body

log = logging.getLogger("mci")


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


RETRY_AFTER_S = "1"  # the Retry-After of a 429 (queue full) or a 503 (waited too long)


def error_response(exc: HTTPError) -> Response:
    # ASCII-escaped JSON: a message may quote the client's own bad text (a lone surrogate in
    # a field name), which must not turn the error into a failure to encode it
    body = json.dumps(error_body(str(exc), exc.type, exc.param, exc.code))
    return Response(body, exc.status, headers=exc.headers, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` with an OpenAI error body."""
    # imported here: requests imports the tokenizer and engine types, errors must stay light
    from mci.server.requests import from_validation_errors

    def invalid(exc: InvalidParameter) -> Response:
        return error_response(
            HTTPError(400, str(exc), "invalid_request_error", exc.param, exc.code)
        )

    @app.exception_handler(HTTPError)
    async def _http_error(_, exc: HTTPError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        return invalid(from_validation_errors(list(exc.errors())))

    @app.exception_handler(InvalidParameter)
    async def _invalid(_, exc: InvalidParameter):
        return invalid(exc)

    @app.exception_handler(UserError)
    async def _user_error(_, exc: UserError):
        return error_response(HTTPError(400, str(exc), "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        return error_response(
            HTTPError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        )

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("internal error")
        return error_response(HTTPError(500, "internal server error", "server_error"))
