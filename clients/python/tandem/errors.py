"""Typed errors of the tandem client: one class per gRPC status code the worker answers.

Every RPC failure surfaces as a `TandemError` subclass carrying the gRPC status code and the
worker's message (which names the offending field, e.g. "max_tokens must be in 1..512, got 0").
Codes without a class of their own raise the base `TandemError`.
"""

from typing import Optional

import grpc


class TandemError(Exception):
    """A failed tandem call. `code` is the grpc.StatusCode, `message` the worker's text."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(TandemError):
    """A malformed request (empty prompt, out-of-range value, bad session id, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TandemError):
    """An unknown session (CloseSession)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(TandemError):
    """The request cannot run in the worker's current state."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(TandemError):
    """The worker has no room (sessions, memory, queue) for the request."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(TandemError):
    """The worker (or its CPU nodes) cannot be reached, or it is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(TandemError):
    """The call was cancelled (by this client, e.g. Stream.cancel() from another thread)."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(TandemError):
    """The call's timeout passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(TandemError):
    """A bug or an unexpected failure on the worker."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
                Cancelled, DeadlineExceeded, Internal)
}


def from_rpc_error(error: grpc.RpcError) -> TandemError:
    """The typed error for a grpc.RpcError raised by a stub call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else None
    cls = _BY_CODE.get(code, TandemError)
    return cls(details or str(error), code)
