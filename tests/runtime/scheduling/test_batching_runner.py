"""The batching runner's loop, driven by hand: a fake backend whose batches take the time a table says on a fake
clock, a model thread that runs a call when the test says so, and nothing that sleeps. Each table row is one
scenario: what is submitted while the model is held by a first batch, and what the model then runs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from scheduling_fakes import Harness

from vit_serve.runtime.scheduling import SHADOW, STALL_S


def run(coro):
    return asyncio.run(coro)


async def held(h: Harness, level: int = 9) -> None:
    """Start the runner and hold its model with a first batch ("blocker", at a level below the others)."""
    h.runner.start()
    await h.submit("blocker", level)
    assert h.runner.running == 1


@pytest.mark.parametrize("arrivals, order", [
    ([("low-1", 3), ("mid-1", 2), ("low-2", 3), ("top-1", 1), ("mid-2", 2), ("top-2", 1)],
     ["top-1", "top-2", "mid-1", "mid-2", "low-1", "low-2"]),
    ([("a", 2), ("b", 2), ("c", 2)], ["a", "b", "c"]),  # arrival order within a level
    ([("shadow", SHADOW), ("bronze", 5), ("gold", 1)], ["gold", "bronze", "shadow"]),
])
def test_the_most_urgent_level_runs_first_then_arrival_order(arrivals, order):
    async def scenario():
        h = Harness(max_batch=1)
        await held(h)
        for name, level in arrivals:
            await h.submit(name, level)
        answered = await h.drain()
        await h.runner.stop()
        return [n for batch in answered for n in batch if n != "blocker"]

    assert run(scenario()) == order


@pytest.mark.parametrize("max_queue, arrivals, outcomes, refusals", [
    # the shadow copy goes first (below every level), then the newest of level 2; an equal level is refused
    (3, [("a", 2), ("shadow", SHADOW), ("b", 2), ("urgent", 1), ("c", 1), ("d", 2)],
     {"a": "ok 1", "shadow": "QueueFullError", "b": "QueueFullError", "urgent": "ok 1", "c": "ok 1",
      "d": "QueueFullError"}, ["shed", "shed", "queue_full"]),
    (2, [("a", 1), ("b", 1), ("c", 1)], {"a": "ok 1", "b": "ok 1", "c": "QueueFullError"}, ["queue_full"]),
    (2, [("a", 3), ("b", 2), ("c", 1), ("d", 1)],
     {"a": "QueueFullError", "b": "QueueFullError", "c": "ok 1", "d": "ok 1"}, ["shed", "shed"]),
])
def test_a_full_queue_sheds_the_least_urgent_newest_for_a_more_urgent_request(max_queue, arrivals, outcomes,
                                                                               refusals):
    async def scenario():
        h = Harness(max_batch=1, max_queue=max_queue)
        await held(h, level=1)
        for name, level in arrivals:
            await h.submit(name, level)
        await h.drain()
        await h.runner.stop()
        return {n: h.outcome(n) for n, _ in arrivals}, h.events.refusals, h.tasks

    got, refused, tasks = run(scenario())
    assert got == outcomes
    assert refused == refusals
    for name, outcome in outcomes.items():
        if outcome == "QueueFullError":
            assert tasks[name].exception().retry_after == "1"


@pytest.mark.parametrize("deadline_ms, advance_ms, outcome, words", [
    (-1, 0, "DeadlineError", "before it reached the queue"),
    (1000, 0, "ok 1", None),
    (300, 400, "DeadlineError", "while it waited"),  # expired in the queue: dropped before its batch
    (300, 250, "DeadlineError", "while it waited"),  # too near its deadline for its own batch (100 ms)
    (300, 150, "ok 1", None),
])
def test_a_deadline_is_refused_at_the_queue_or_dropped_before_its_batch(deadline_ms, advance_ms, outcome, words):
    async def scenario():
        h = Harness(max_batch=1, backend_args={"ms_per_row": 100})
        h.runner.cost.seed("classify", 0.1)
        await held(h)
        await h.submit("late", 1, deadline_ms)
        h.clock.advance_ms(advance_ms - 100)  # the blocker's batch takes 100 ms of it
        await h.drain()
        await h.runner.stop()
        return h.outcome("late"), h.tasks["late"], h.events.refusals, h.backend.calls

    got, task, refused, calls = run(scenario())
    assert got == outcome
    if words is not None:
        assert words in str(task.exception())
        assert refused == ["deadline"] and len(calls) == 1  # the blocker alone ran


def test_a_deadline_the_work_ahead_cannot_meet_is_refused_as_it_is_queued():
    """Six batches of 100 ms ahead and 200 ms left: refused now, never queued; with 800 ms left it is queued."""
    async def scenario():
        h = Harness(max_batch=1, backend_args={"ms_per_row": 100})
        h.runner.cost.seed("classify", 0.1)
        await held(h)
        for i in range(6):
            await h.submit(f"q{i}", 1)
        await h.submit("short", 2, deadline_ms=200)
        depth = h.runner.depth
        await h.submit("patient", 2, deadline_ms=2000)
        await h.drain()
        await h.runner.stop()
        return h.tasks["short"], depth, h.outcome("patient")

    short, depth, patient = run(scenario())
    assert "batches ahead of it need about" in str(short.exception()) and depth == 6
    assert patient == "ok 1"


@pytest.mark.parametrize("overrun, deadline_ms, sizes", [
    (None, None, [4, 4, 4, 4]),
    (0.0, 350, [2, 2, 2, 2]),  # 250 ms left once the blocker ran, 100 ms a row: two rows
    (0.5, 350, [1, 3, 3, 3]),  # batches ran 35% over their prediction: room for twice that, one row
])
def test_a_batch_holds_no_more_rows_than_its_first_requests_deadline_allows(overrun, deadline_ms, sizes):
    async def scenario():
        h = Harness(max_batch=8, backend_args={"ms_per_row": 100})
        if overrun is not None:
            h.runner.cost.seed("classify", 0.1, overrun)
        await held(h, level=1)
        await h.submit("first", 1, deadline_ms)
        for name in ("a", "b", "c"):
            await h.submit(name, 1)
        await h.drain()
        await h.runner.stop()
        return h.sizes(["first", "a", "b", "c"])

    assert run(scenario()) == sizes


@pytest.mark.parametrize("levels, quiet_ms, sizes", [
    ([2, 1, 2, 1, 2], 0, [1, 2, 1, 2, 1]),  # level 1 active: level 2 one image a batch; level 1's two together
    ([1, 2, 2], 0, [1, 1, 1]),
    ([1, 2, 2], 2000, [1, 2, 2]),  # level 1 quiet for ACTIVE_S: level 2 batches together again
    ([2, 2, 2], 0, [3, 3, 3]),
])
def test_a_batch_holds_one_level_and_one_image_beside_a_more_urgent_level(levels, quiet_ms, sizes):
    async def scenario():
        h = Harness(max_batch=8)
        await held(h)
        names = [f"r{i}" for i in range(len(levels))]
        for name, level in zip(names, levels, strict=True):
            await h.submit(name, level)
        h.clock.advance_ms(quiet_ms)
        await h.drain()
        await h.runner.stop()
        return h.sizes(names)

    assert run(scenario()) == sizes


@pytest.mark.parametrize("instances, concurrent, levels, running", [
    (2, True, [2, 2, 2], 2),
    (2, False, [2, 2, 2], 1),  # a backend that runs one batch at a time
    (2, True, [1, 2, 2], 1),  # level 1 active: one instance kept free for its next request
    (3, True, [1, 2, 2], 2),
    (1, True, [2, 2, 2], 1),
])
def test_instances_run_batches_at_once_and_keep_one_free_for_an_urgent_level(instances, concurrent, levels,
                                                                              running):
    async def scenario():
        h = Harness(max_batch=1, instances=instances, backend_args={"concurrent": concurrent})
        h.runner.start()
        for i, level in enumerate(levels):
            await h.submit(f"r{i}", level)
        got = len(h.thread.waiting)
        await h.drain()
        await h.runner.stop()
        return got, [h.outcome(f"r{i}") for i in range(len(levels))]

    got, outcomes = run(scenario())
    assert got == running
    assert outcomes == ["ok 1"] * len(levels)


@pytest.mark.parametrize("urgent_arrives, calls, preemptions", [
    # level 2's batch starts in stages (level 1 is active); level 1's next request takes its instance after a stage
    (True, ["whole", "stage", "whole", "stage", "stage", "stage"], 1),
    (False, ["whole", "stage", "stage", "stage", "stage"], 0),
])
def test_a_staged_batch_gives_its_instance_to_more_urgent_work_between_stages(urgent_arrives, calls, preemptions):
    async def scenario():
        h = Harness(max_batch=1, backend_args={"stages": 4})
        await held(h, level=1)  # level 1 is active
        await h.submit("low", 2)
        await h.step()  # the blocker ends; low's batch starts, in stages: its first stage waits for the thread
        if urgent_arrives:
            await h.submit("urgent", 1)
        answered = await h.drain()
        await h.runner.stop()
        return [c[0] for c in h.backend.calls], h.events.preemptions, answered

    got, preempted, answered = run(scenario())
    assert got == calls and preempted == preemptions
    if urgent_arrives:
        assert answered == [["urgent"], ["low"]]


@pytest.mark.parametrize("cancel, ran", [
    ("b", [1, 1]),  # the blocker and a: b left the queue, never ran
    ("a", [1, 1]),
    (None, [1, 1, 1]),
])
def test_a_request_whose_caller_went_away_leaves_the_queue(cancel, ran):
    async def scenario():
        h = Harness(max_batch=1)
        await held(h)
        await h.submit("a", 1)
        await h.submit("b", 1)
        if cancel is not None:
            h.tasks[cancel].cancel()
            await h.settle()
        depth = h.runner.depth
        await h.drain()
        await h.runner.stop()
        return depth, [rows for _, _, rows in h.backend.calls]

    depth, rows = run(scenario())
    assert depth == (2 if cancel is None else 1)
    assert rows == ran


def test_a_staged_batch_stops_once_everyone_in_it_left():
    async def scenario():
        h = Harness(max_batch=1, backend_args={"stages": 4})
        await held(h, level=1)
        await h.submit("low", 2)
        await h.step()  # the blocker ends; low starts in stages
        await h.step()
        h.tasks["low"].cancel()
        await h.drain()
        await h.runner.stop()
        return [c[0] for c in h.backend.calls]

    assert run(scenario()) == ["whole", "stage", "stage"]  # the stage under way finishes; no more


@pytest.mark.parametrize("fail_on, outcomes", [
    ((2,), {"a": "RuntimeError", "b": "RuntimeError", "c": "ok 1"}),  # the batch of two failed, for both
    ((1,), {"a": "ok 2", "b": "ok 2", "c": "RuntimeError"}),
    ((), {"a": "ok 2", "b": "ok 2", "c": "ok 1"}),
])
def test_a_failed_batch_is_the_answer_of_each_request_in_it_and_the_next_batch_runs(fail_on, outcomes):
    async def scenario():
        h = Harness(max_batch=2, backend_args={"fail_on": fail_on, "ms": {3: 30}})
        h.runner.start()
        await h.submit("blocker", 9, rows=3)
        for name in outcomes:
            await h.submit(name, 1)
        await h.drain()
        await h.runner.stop()
        return {n: h.outcome(n) for n in outcomes}

    assert run(scenario()) == outcomes


@pytest.mark.parametrize("heard_ms_ago, first_batch", [
    (None, 2),  # being decoded (no body being read): it is coming, the batch waits for it
    (0, 2),  # its bytes keep coming
    (STALL_S * 1e3 + 1, 1),  # stalled: the batch does not wait for it
])
def test_a_batch_waits_only_for_requests_still_coming(heard_ms_ago, first_batch):
    async def scenario():
        h = Harness(max_batch=4, max_delay_ms=1000)
        h.runner.start()
        arrival = h.runner.arriving(1)
        if heard_ms_ago is not None:
            arrival.heard_from(SimpleNamespace(last=h.clock.now() - heard_ms_ago / 1e3))
        await h.submit("first", 1)
        started = len(h.thread.waiting)
        await h.submit("second", 1, arrival=arrival)
        await h.drain()
        await h.runner.stop()
        return started, h.sizes(["first"])[0]

    started, size = run(scenario())
    assert size == first_batch
    assert started == (first_batch == 1)


def test_a_request_of_more_than_max_batch_images_runs_in_parts_and_is_answered_joined():
    async def scenario():
        h = Harness(max_batch=2)
        h.runner.start()
        await h.submit("big", 1, rows=5)
        await h.drain()
        await h.runner.stop()
        return h.tasks["big"].result(), [rows for _, _, rows in h.backend.calls]

    result, rows = run(scenario())
    assert rows == [2, 2, 1]
    assert result.outputs["logits"][:, 0].tolist() == [0, 1, 2, 3, 4] and result.batch_size == 2


def test_stop_answers_what_waits_and_runs_not_ready():
    async def scenario():
        h = Harness(max_batch=1)
        await held(h)
        await h.submit("a", 1)
        await h.runner.stop()
        await h.settle()
        return h.outcome("blocker"), h.outcome("a"), h.runner.depth

    assert run(scenario()) == ("NotReadyError", "NotReadyError", 0)


def test_stop_ends_the_collector_when_its_wakeup_and_the_cancel_land_in_one_step():
    """Python 3.11's asyncio.wait_for returns the awaited result instead of raising when a cancellation and the
    awaited event land in the same step; stop() still ends the collector (offline predict once hung here)."""
    async def scenario():
        h = Harness(max_batch=4, max_delay_ms=1000)
        h.runner.start()
        h.runner.arriving(1)  # more is coming: the collector waits for the batch to fill
        await h.submit("first", 1)
        assert not h.thread.waiting  # it waits: nothing runs yet
        h.runner.arrivals.news.set()  # its wait ends in the step where stop()'s cancel lands
        stop = asyncio.ensure_future(h.runner.stop())
        ended, _ = await asyncio.wait({stop}, timeout=5)  # a timeout that does not cancel stop() (that would help)
        stop.cancel()
        return bool(ended), h.outcome("first")

    assert run(scenario()) == (True, "NotReadyError")
