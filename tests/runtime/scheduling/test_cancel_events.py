"""A request whose caller went away is reported cancelled once, at the stage it reached: by the runner when the
runner holds it (queued, or in a batch, whole or staged; the direct runner's call sent), else by whoever noticed
(`Ticket.caller_left` says which). A cancellation whose caller did not leave (an unload) is not reported. Fake
clock, fake backend, a model thread run by hand: nothing sleeps."""

from __future__ import annotations

import asyncio

import pytest
from scheduling_fakes import Harness, image
from test_direct import HeldServer

from vit_serve.runtime.scheduling import DirectRunner, FakeClock, Ticket
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import CLASSIFY


def run(coro):
    return asyncio.run(coro)


async def _leave(h: Harness, name: str, ticket: Ticket, caller_left: bool) -> bool | None:
    """Cancel `name`'s task, its caller said to have left first (`caller_left`): what `caller_left` answered."""
    said = ticket.caller_left() if caller_left else None
    h.tasks[name].cancel()
    await h.settle()
    return said


@pytest.mark.parametrize("stage, staged, caller_left, reported, whoever_noticed_counts", [
    ("queue", False, True, ["queue"], False),  # queued behind the blocker: the runner reports it
    ("infer", True, True, ["infer"], False),  # its staged batch had started
    ("queue", False, False, [], None),  # cancelled by an unload: its caller did not leave
    ("infer", True, False, [], None),
])
def test_the_batching_runner_reports_a_request_whose_caller_left_at_its_stage(stage, staged, caller_left, reported,
                                                                              whoever_noticed_counts):
    async def scenario():
        h = Harness(max_batch=1, backend_args={"stages": 4} if staged else {})
        h.runner.start()
        await h.submit("blocker", 1)
        ticket = Ticket(arrived=h.clock.now(), priority=2)
        h.tasks["a"] = asyncio.create_task(h.runner.submit(CLASSIFY, image(10), None, ticket))
        await h.settle()
        if stage == "infer":
            await h.step()  # the blocker ends; a's batch starts in stages: its first stage waits for the thread
        at, held = ticket.stage, ticket.held
        said = await _leave(h, "a", ticket, caller_left)
        await h.drain()
        await h.runner.stop()
        return at, held, said, h.outcome("a"), h.events.cancellations, ticket.held

    at, held, said, outcome, cancellations, held_after = run(scenario())
    assert (at, held) == (stage, True)
    assert said is whoever_noticed_counts
    assert outcome == "cancelled"
    assert cancellations == reported
    assert held_after is False


def test_a_request_not_in_a_runner_is_counted_by_whoever_noticed_once():
    async def scenario():
        h = Harness(max_batch=1)
        h.runner.start()
        answered = Ticket(arrived=h.clock.now())
        h.tasks["a"] = asyncio.create_task(h.runner.submit(CLASSIFY, image(0), None, answered))
        await h.settle()
        await h.drain()
        await h.runner.stop()
        # answered, then its caller left (while the gateway post-processed, say): the runner no longer holds it
        return h.outcome("a"), answered.caller_left(), answered.caller_left(), h.events.cancellations

    outcome, first, second, cancellations = run(scenario())
    assert outcome == "ok 1"
    assert (first, second) == (True, False)  # counted by whoever noticed, and only once
    assert cancellations == []


def test_a_multi_part_request_is_reported_once():
    async def scenario():
        h = Harness(max_batch=2)
        h.runner.start()
        await h.submit("blocker", 1)
        ticket = Ticket(arrived=h.clock.now(), priority=2)
        h.tasks["a"] = asyncio.create_task(h.runner.submit(CLASSIFY, image(10, rows=5), None, ticket))
        await h.settle()
        parts = h.runner.depth
        said = await _leave(h, "a", ticket, True)
        await h.drain()
        await h.runner.stop()
        return parts, said, h.events.cancellations, [rows for _, _, rows in h.backend.calls]

    parts, said, cancellations, rows = run(scenario())
    assert parts == 3 and said is False
    assert cancellations == ["queue"]
    assert rows == [1]  # only the blocker ran: no part of the request did


@pytest.mark.parametrize("caller_left, reported", [(True, ["infer"]), (False, [])])
def test_the_direct_runner_reports_a_sent_request_whose_caller_left(caller_left, reported):
    async def scenario():
        server, events = HeldServer(), Harness().events
        runner = DirectRunner(server, RunnerLimits(max_batch=2, max_queue=4), events, None, FakeClock(5.0))
        ticket = Ticket(arrived=5.0)
        task = asyncio.create_task(runner.submit(CLASSIFY, image(0, 3), None, ticket))
        for _ in range(20):
            await asyncio.sleep(0)
        sent, held = len(server.options), ticket.held
        said = ticket.caller_left() if caller_left else None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sent, held, said, task.cancelled(), events.cancellations, runner.depth

    sent, held, said, cancelled, cancellations, depth = run(scenario())
    assert (sent, held, cancelled, depth) == (2, True, True, 0)
    assert said is (False if caller_left else None)
    assert cancellations == reported
