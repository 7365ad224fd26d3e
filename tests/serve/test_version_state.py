"""The lifecycle of a loaded version (vit_serve.serve.version_state): every pair of phases, legal or not."""

from __future__ import annotations

import itertools

import pytest

from vit_serve.serve.version_state import IllegalTransitionError, Phase, VersionState, VersionStatus

L, R, F, D, S, U = Phase.LOADING, Phase.READY, Phase.FAILED, Phase.DRAINING, Phase.STOPPING, Phase.UNLOADED

# What model_version.ModelVersion does, written out here rather than read from the table under test.
LEGAL = {
    (L, R),  # warmed up
    (L, F),  # the warm-up failed
    (F, L),  # a readiness probe tries the warm-up again
    (L, D), (F, D), (R, D),  # closed (unloaded, replaced, refused after a failed warm-up, the server stopping)
    (D, S),  # the grace is over, or nothing holds it any more: its runner stops
    (S, U),  # runner, backend and thread closed
}
PAIRS = list(itertools.product(Phase, Phase))


@pytest.mark.parametrize(("old", "new"), [p for p in PAIRS if p in LEGAL])
def test_legal_transitions_move(old: Phase, new: Phase) -> None:
    status = VersionStatus("tiny version 1", old)
    assert status.move(new) is old
    assert status.phase is new


@pytest.mark.parametrize(("old", "new"), [p for p in PAIRS if p not in LEGAL])
def test_illegal_transitions_are_refused_and_change_nothing(old: Phase, new: Phase) -> None:
    status = VersionStatus("tiny version 1", old)
    status.reason = "warm-up failed: boom"
    with pytest.raises(IllegalTransitionError, match=f"tiny version 1: cannot go from {old} to {new}") as e:
        status.move(new, "other")
    assert (e.value.old, e.value.new) == (old, new)
    assert (status.phase, status.reason) == (old, "warm-up failed: boom")


def test_the_error_names_the_allowed_phases() -> None:
    with pytest.raises(IllegalTransitionError, match=r"from READY a version may go to DRAINING$"):
        VersionStatus("m version 2", R).move(L)
    with pytest.raises(IllegalTransitionError, match=r"may go to nowhere \(it is final\)"):
        VersionStatus("m version 2", U).move(L)


def test_a_failed_warm_up_keeps_its_reason_until_ready() -> None:
    status = VersionStatus("m version 1")
    status.move(F, "warm-up failed: out of memory")
    status.move(L)  # tried again
    assert status.reason == "warm-up failed: out of memory"
    status.move(R)
    assert status.reason == ""


@pytest.mark.parametrize(("path", "state", "reason", "closing", "stopped"), [
    ([], "LOADING", "", False, False),
    ([R], "READY", "", False, False),
    ([F], "LOADING", "warm-up failed: x", False, False),
    ([F, L], "LOADING", "warm-up failed: x", False, False),
    ([F, D], "UNLOADING", "", True, False),
    ([R, D], "UNLOADING", "", True, False),
    ([R, D, S], "UNLOADING", "", True, True),
    ([R, D, S, U], "UNLOADING", "", True, True),
])
def test_index_rows_and_flags_by_phase(path: list[Phase], state: str, reason: str, closing: bool,
                                       stopped: bool) -> None:
    status = VersionStatus("m version 3")
    for phase in path:
        status.move(phase, "warm-up failed: x" if phase is F else None)
    assert status.index_row("m", 3) == VersionState("m", 3, state, reason)  # type: ignore[arg-type]
    assert (status.closing, status.stopped) == (closing, stopped)
