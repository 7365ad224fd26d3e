"""The runtime's errors: what a request can be refused for, or fail with, whatever protocol carries it.

Every one is a `ServingError`: `message` is the one line the caller is told, `retry_after` (seconds, as the text
a client is sent, e.g. "1") is set when retrying later may succeed. The runtime knows no protocol: the gateway
maps each class to its HTTP and gRPC status in one table (`vit_serve.serve.errors`). Preprocessing's own errors
(`vit_serve.preprocess.ImageDecodeError`, `ImageTooLargeError`) stay preprocessing's; `runtime.decode` turns
them into the errors below.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "InvalidInputError",
    "InvalidValueError",
    "ModelTimeoutError",
    "NotFoundError",
    "NotReadyError",
    "QueueFullError",
    "ServingError",
    "TooLargeError",
    "UnreadableImageError",
    "UnsupportedMediaError",
]


class ServingError(Exception):
    """A request the runtime refuses or cannot answer now, with the one-line `message` its caller is told."""

    def __init__(self, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __reduce__(self) -> tuple:  # pickled across processes (Ray replicas) with its retry advice
        return type(self)._rebuild, (self.args, self.message, self.retry_after)

    @classmethod
    def _rebuild(cls, args: tuple, message: str, retry_after: str | None) -> ServingError:
        error = cls.__new__(cls)
        Exception.__init__(error, *args)
        error.message, error.retry_after = message, retry_after
        return error


class InvalidInputError(ServingError):
    """A malformed request (HTTP 400)."""


class InvalidValueError(ServingError):
    """A well-formed request with an unusable value (HTTP 422)."""


class NotFoundError(ServingError):
    """No such model, version or stored image (HTTP 404)."""


class TooLargeError(ServingError):
    """An input over a limit: an image's pixels, a body's bytes (HTTP 413)."""


class UnsupportedMediaError(ServingError):
    """Bytes that are no image in a format the runtime reads (HTTP 415)."""


class UnreadableImageError(ServingError):
    """An image in a known format that cannot be decoded: corrupt or truncated (HTTP 422)."""


class NotReadyError(ServingError):
    """The model is loading, unloading or not loaded (HTTP 503)."""


class QueueFullError(ServingError):
    """The model's queue is full; `retry_after` says when to come back (HTTP 503 + Retry-After)."""


class ModelTimeoutError(ServingError):
    """The model did not answer in time (HTTP 504)."""


class BackendUnavailableError(ServingError, RuntimeError):
    """The backend cannot answer now (e.g. the Triton server is down; HTTP 503 + Retry-After: 1).

    `str(error)` says why and names internal hosts (a Triton URL, a Ray deployment): it is for the log. The
    caller is told `message`, the same line whatever the cause.
    """

    PUBLIC_MESSAGE = "the model's backend is unavailable; retry later"

    def __init__(self, reason: str) -> None:
        super().__init__(self.PUBLIC_MESSAGE, retry_after="1")
        self.args = (reason,)
