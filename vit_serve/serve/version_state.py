"""A loaded version's lifecycle: its phases, the transitions allowed between them (one table, `TRANSITIONS`), and the
one call that makes a transition (`VersionStatus.move`), which refuses every other with `IllegalTransitionError`.

    LOADING --warmed up--> READY --closed--> DRAINING --grace over or idle--> STOPPING --runner stopped--> UNLOADED
       |  ^                                     ^
       v  | tried again (readiness)             |
     FAILED ------------------------------------+  (LOADING and FAILED may be closed too)

* LOADING: built (backend, thread, runner) and warming up; at start-up it already takes requests.
* READY: warmed up.
* FAILED: its warm-up failed (`reason`); a readiness probe tries again (back to LOADING, the reason kept until the
  warm-up succeeds).
* DRAINING: being unloaded: it finishes the requests that hold it, waiting at most the unload grace.
* STOPPING: its runner is stopped: requests still queued or running are answered 503.
* UNLOADED: closed (runner, backend, thread and gauges gone).

Only `model_version.ModelVersion` moves its status (`warm_up`, `warm_up_soon`, `close`). The repository's index
(Triton's `{"name", "version", "state", "reason"}`, `VersionState`) shows a loaded version by `INDEX_STATE`; the
states of versions that have no `ModelVersion` (being built, refused, not wanted) are the repository's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Literal

StateName = Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]


class Phase(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    UNLOADED = "UNLOADED"


TRANSITIONS: Mapping[Phase, frozenset[Phase]] = MappingProxyType({
    Phase.LOADING: frozenset({Phase.READY, Phase.FAILED, Phase.DRAINING}),
    Phase.FAILED: frozenset({Phase.LOADING, Phase.DRAINING}),
    Phase.READY: frozenset({Phase.DRAINING}),
    Phase.DRAINING: frozenset({Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.UNLOADED}),
    Phase.UNLOADED: frozenset(),
})

# How the repository index names a loaded version's phase (a failed warm-up is LOADING there, with its reason).
INDEX_STATE: Mapping[Phase, StateName] = MappingProxyType({
    Phase.LOADING: "LOADING",
    Phase.FAILED: "LOADING",
    Phase.READY: "READY",
    Phase.DRAINING: "UNLOADING",
    Phase.STOPPING: "UNLOADING",
    Phase.UNLOADED: "UNLOADING",
})

CLOSING = frozenset({Phase.DRAINING, Phase.STOPPING, Phase.UNLOADED})  # `close` has begun
STOPPED = frozenset({Phase.STOPPING, Phase.UNLOADED})  # nothing more is answered


@dataclass(frozen=True)
class VersionState:
    """One row of the repository index (Triton's `{"name", "version", "state", "reason"}`)."""

    name: str
    version: int | None  # None: a model of REPO that was never loaded
    state: StateName | None
    reason: str = ""


class IllegalTransitionError(RuntimeError):
    """A move the table (`TRANSITIONS`) does not allow: a bug in the caller, never a client's error."""

    def __init__(self, label: str, old: Phase, new: Phase) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "nowhere (it is final)"
        super().__init__(f"{label}: cannot go from {old} to {new}; from {old} a version may go to {allowed}")
        self.old, self.new = old, new


class VersionStatus:
    """The phase of one loaded version and why it is there (`reason`: a failed warm-up's message, else "")."""

    __slots__ = ("label", "phase", "reason")

    def __init__(self, label: str, phase: Phase = Phase.LOADING) -> None:
        self.label, self.phase, self.reason = label, phase, ""

    def move(self, to: Phase, reason: str | None = None) -> Phase:
        """Go to `to` (the phase left is returned); `reason` replaces the reason (None keeps it; READY clears it).
        IllegalTransitionError, changing nothing, when the table does not allow it."""
        old = self.phase
        if to not in TRANSITIONS[old]:
            raise IllegalTransitionError(self.label, old, to)
        self.phase = to
        if to is Phase.READY:
            self.reason = ""
        elif reason is not None:
            self.reason = reason
        return old

    @property
    def closing(self) -> bool:
        return self.phase in CLOSING

    @property
    def stopped(self) -> bool:
        return self.phase in STOPPED

    def index_row(self, name: str, version: int) -> VersionState:
        """This version's row of the repository index: its state (`INDEX_STATE`), and the reason of a warm-up that
        failed while it is not yet READY."""
        state = INDEX_STATE[self.phase]
        return VersionState(name, version, state, self.reason if state == "LOADING" else "")

    def __repr__(self) -> str:
        return f"VersionStatus({self.label!r}, {self.phase}, reason={self.reason!r})"
