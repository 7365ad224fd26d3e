"""One request's terms with the queue: who sent it, how urgent it is, when it must be answered by, which session
it belongs to, and where it is now (`Admission`).

Priority levels are Triton's: 1 is the most urgent and a larger number waits behind a smaller one. A key's level
comes from the keys file (`security.KeyRing`); a request may lower its own (`/v2` `parameters.priority`, gRPC's
`priority` parameter) but never raise it (`lowered`). Shadow copies (`traffic`) run at `SHADOW`, below every
level: they are the first work shed.

Deadlines: `?timeout_ms=` or `X-Request-Timeout-Ms` (HTTP routes, milliseconds), `parameters.timeout` in
microseconds (`/v2` and gRPC), and the gRPC call's own deadline. 0 in the first two is no deadline (Triton's
meaning of its `timeout`); a negative or non-finite value is 422. The earliest wins, counted from the request's
arrival. A request whose deadline has passed, or that the batcher predicts it cannot answer in time, is refused
with 504 / DEADLINE_EXCEEDED instead of being run late (`vit_serve.runtime.scheduling`).

`Admission` is the scheduler's `Ticket` (`vit_serve.runtime.scheduling.ticket`) with the gateway's errors;
the HTTP parts (the ASGI scope, `X-Request-Timeout-Ms`) are here.

Stages, for `vit_serve_cancelled_total{stage}` (a client that hung up, `hangup`): read (its body), decode, queue,
infer (its batch had started: the answer is thrown away).
"""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.types import Scope

from vit_serve.runtime.scheduling.ticket import ANONYMOUS, DEFAULT_PRIORITY, SHADOW, STAGES, Caller, Stage, Ticket
from vit_serve.serve.errors import GatewayTimeoutError, InvalidValueError

__all__ = ["ANONYMOUS", "DEFAULT_PRIORITY", "SCOPE_KEY", "SHADOW", "STAGES", "TIMEOUT_HEADER", "Admission", "Caller",
           "Stage", "admission_of", "deadline_exceeded", "header_timeout_ms"]

TIMEOUT_HEADER = "x-request-timeout-ms"
SCOPE_KEY = "vit_serve.admission"  # where an HTTP request's Admission lives in its ASGI scope


class Admission(Ticket):
    """A request's `Ticket` as the gateway keeps it: its bad terms are the gateway's 422 (`InvalidValueError`), and
    its progress names the model version it reached."""

    invalid: ClassVar[type[InvalidValueError]] = InvalidValueError

    def check(self, mv: Any = None, where: str = "on arrival") -> None:
        """504 now if the deadline has already passed (counted as `mv`'s, a ModelVersion, refusal)."""
        left = self.remaining()
        if left is not None and left <= 0:
            if mv is not None:
                mv.metrics.rejected("deadline").inc()
            raise deadline_exceeded(f"{where}, {-left * 1e3:.0f} ms after it")

    def at(self, stage: Stage, mv: Any = None) -> None:
        """The request has reached `stage` (on `mv`, a ModelVersion, once known)."""
        self.stage = stage
        if mv is not None:
            self.model, self.version = mv.name, str(mv.version)


def deadline_exceeded(detail: str) -> GatewayTimeoutError:
    """The 504 / DEADLINE_EXCEEDED of a request refused for its deadline (the scheduler's own is
    `vit_serve.runtime.scheduling.errors.deadline_exceeded`: the same answer)."""
    return GatewayTimeoutError(f"the request's deadline has passed ({detail}); it was not run")


def admission_of(scope: Scope) -> Admission:
    """The HTTP request's Admission (`hangup.HangUp` makes it as the request arrives; made here when a request
    came another way)."""
    found = scope.get(SCOPE_KEY)
    if found is None:
        found = scope[SCOPE_KEY] = Admission()
    return found


def header_timeout_ms(scope: Scope) -> float | None:
    """`X-Request-Timeout-Ms` (None when absent); 422 when it is not a number."""
    for k, v in scope.get("headers", ()):
        if k.lower() == TIMEOUT_HEADER.encode():
            try:
                return float(v.decode("latin-1"))
            except ValueError:
                raise InvalidValueError("X-Request-Timeout-Ms must be a number of milliseconds") from None
    return None
