"""Errors that carry a gRPC status code; one interceptor (services/common/grpc_utils.py) maps them, and the
HTTP front maps the same codes to HTTP statuses."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None, endpoint: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.endpoint = endpoint
        """The worker the error came from, when one did (the router retries elsewhere)."""

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When a retry may succeed: gRPC trailer `retry-after-ms`, HTTP header `Retry-After`."""


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.DATA_LOSS: 502,
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)
