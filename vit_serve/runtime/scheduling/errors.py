"""What the scheduler refuses or fails a request with, in no protocol's terms (the gateway maps each to its HTTP
status and gRPC code, `vit_serve.serve.errors`, through the runtime errors they derive from).

- `QueueFullError(message, retry_after)`: the queue is full, or the request was shed for a more urgent one
  (503 + Retry-After).
- `DeadlineError`: its deadline has passed or cannot be met, or it waited past the request timeout (504).
- `NotReadyError`: the runner stopped (the model is being unloaded) before it was answered (503).
"""

from __future__ import annotations

from vit_serve.runtime import errors as runtime
from vit_serve.runtime.errors import NotReadyError

__all__ = ["REFUSALS", "DeadlineError", "NotReadyError", "QueueFullError", "deadline_exceeded", "request_timed_out"]


class QueueFullError(runtime.QueueFullError):
    """No room in the queue; `retry_after` (the text a client is sent, e.g. "1") says when to come back."""


class DeadlineError(runtime.ModelTimeoutError):
    """Not answered in time: the request's deadline, or the runner's request timeout."""


REFUSALS = (QueueFullError, DeadlineError, NotReadyError)  # what a runner refuses a request with


def deadline_exceeded(detail: str) -> DeadlineError:
    """The refusal of a request for its deadline (504 / DEADLINE_EXCEEDED)."""
    return DeadlineError(f"the request's deadline has passed ({detail}); it was not run")


def request_timed_out(timeout_s: float) -> DeadlineError:
    """No answer within the runner's request timeout (504)."""
    return DeadlineError(f"no answer within {timeout_s:g} s (VIT_SERVE_REQUEST_TIMEOUT_S)")
