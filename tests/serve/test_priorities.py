"""The batcher's order and refusals with the real gateway and model (the scheduler's own rules, as tables over a
fake backend and clock: tests/runtime/scheduling): the most urgent level runs first, a full queue
sheds the least urgent newest request for a more urgent one, and a request that cannot meet its deadline is
refused at the queue or dropped before its batch (504), never run late.

As in test_batching, requests are held in the queue by occupying the version's single model thread with a task
that waits on an event: nothing runs until it is released, so the order the model takes them in is the order
the batcher chose.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from gateway_helpers import metric, run, serving, settings_for

from vit_serve.runtime.scheduling import DeadlineError, QueueFullError
from vit_serve.runtime.task import CLASSIFY
from vit_serve.serve.admission import SHADOW, Admission


async def _until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _x(mv, i: int) -> np.ndarray:
    h, w = mv.info.resolution
    return np.random.default_rng(i).standard_normal((1, 3, h, w)).astype(np.float32)


async def _hold(mv) -> tuple[threading.Event, asyncio.Task]:
    """Occupy the model thread, and put one request in the batch waiting for it: what is submitted afterwards
    waits in the queue until the event is set."""
    gate = threading.Event()
    mv.thread.submit(gate.wait)
    blocker = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 99), None, Admission()))
    await _until(lambda: mv.runner.running == 1)
    return gate, blocker


def test_a_full_queue_sheds_the_least_urgent_newest_for_a_more_urgent_request(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1, max_queue=3)) as (client, app):
            mv = app.state.gateway.model()
            gate, blocker = await _hold(mv)
            jobs = {"blocker": blocker}
            for name, level in [("a", 2), ("shadow", SHADOW), ("b", 2)]:
                jobs[name] = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 0), None, Admission(priority=level)))
                n = len(jobs) - 1
                await _until(lambda n=n: mv.runner.depth == n)
            jobs["urgent"] = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 1), None, Admission(priority=1)))
            await _until(lambda: jobs["shadow"].done())
            jobs["c"] = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 2), None, Admission(priority=1)))
            await _until(lambda: jobs["b"].done())
            jobs["d"] = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 3), None, Admission(priority=2)))
            await _until(lambda: jobs["d"].done())
            gate.set()
            outcomes = {}
            for name, job in jobs.items():
                try:
                    await job
                    outcomes[name] = "ok"
                except QueueFullError as e:
                    outcomes[name] = f"503 {e.retry_after}"
            return outcomes, (await client.get("/metrics")).text

    outcomes, text = run(scenario())
    # the shadow copy went first (below every level), then the newest of level 2; an equal level is refused
    assert outcomes == {"blocker": "ok", "a": "ok", "shadow": "503 1", "b": "503 1", "urgent": "ok", "c": "ok",
                        "d": "503 1"}
    assert metric(text, "vit_serve_rejected_total", reason="shed") == 2
    assert metric(text, "vit_serve_rejected_total", reason="queue_full") == 1


def test_deadlines_refuse_at_the_queue_and_drop_before_the_batch(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1)) as (client, app):
            mv = app.state.gateway.model()
            for i in range(3):  # the batcher learns how long a batch takes
                await mv.infer(CLASSIFY, _x(mv, i), None, Admission())
            per_batch = mv.runner.cost.row_s("classify")  # batches of one: a batch's time
            gate, blocker = await _hold(mv)
            queued = [asyncio.create_task(mv.infer(CLASSIFY, _x(mv, i), None, Admission())) for i in range(6)]
            await _until(lambda: mv.runner.depth == 6)
            outcome = {}
            # at a lower level, six batches ahead and time for two: refused now, not queued
            short = Admission(deadline=time.perf_counter() + 2 * per_batch, priority=2)
            try:
                await mv.infer(CLASSIFY, _x(mv, 9), None, short)
            except DeadlineError as e:
                outcome["predicted"] = str(e)
            outcome["depth"] = mv.runner.depth
            # 0.3 s left, the earliest deadline of its level: first in line, admitted; the model stays busy
            urgent = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 10), None,
                                                  Admission(deadline=time.perf_counter() + 0.3)))
            await _until(lambda: mv.runner.depth == 7)
            past = Admission(deadline=time.perf_counter() - 0.001)
            try:
                await mv.infer(CLASSIFY, _x(mv, 11), None, past)
            except DeadlineError as e:
                outcome["past"] = str(e)
            try:
                await urgent
            except DeadlineError as e:
                outcome["expired"] = str(e)
            before = metric((await client.get("/metrics")).text, "vit_serve_batch_size_sum", task="classify")
            gate.set()
            await asyncio.gather(blocker, *queued)
            after = metric((await client.get("/metrics")).text, "vit_serve_batch_size_sum", task="classify")
            return outcome, before, after, (await client.get("/metrics")).text

    outcome, before, after, text = run(scenario())
    assert "batches ahead of it need" in outcome["predicted"] and outcome["depth"] == 6
    assert "before it reached the queue" in outcome["past"]
    assert "while it waited" in outcome["expired"]
    assert after - before == 6  # the six queued ran; the three refused never did (the blocker was counted before)
    assert metric(text, "vit_serve_rejected_total", reason="deadline") == 3


def test_the_arrival_check_counts_what_is_coming_at_its_level_or_above(tiny_ckpt):
    """`check_arrival` (the 504 before a body is read): behind the held model, with ten level-2 requests being
    read and a run time of 0.1 s an image, a level-2 request with 0.3 s left is refused (ten images ahead of
    it), a level-1 one is not (nothing of its level is coming), and neither is one without a deadline."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8)) as (_, app):
            mv = app.state.gateway.model()
            gate, blocker = await _hold(mv)
            mv.runner.cost.seed("classify", 0.1)
            coming = [mv.arriving(2) for _ in range(10)]
            outcomes = {}
            for name, admission in (("bronze", Admission(priority=2)), ("gold", Admission(priority=1)),
                                    ("patient", Admission(priority=2))):
                if name != "patient":
                    admission.within(0.3, "the test's")
                arrival = mv.arriving(admission.priority)  # announced, as the routes do before the check
                try:
                    mv.runner.check_arrival(CLASSIFY, admission)
                    outcomes[name] = "admitted"
                except DeadlineError as e:
                    outcomes[name] = str(e)
                finally:
                    arrival.done()
            for a in coming:
                a.done()
            gate.set()
            await blocker
            return outcomes

    outcomes = run(scenario())
    assert outcomes["gold"] == outcomes["patient"] == "admitted"
    assert "the batches ahead of it need about" in outcomes["bronze"]


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_a_bad_timeout_is_422(tiny_ckpt, photos, value):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            return (await client.post("/classify", content=photos["coffee.jpg"],
                                      headers={"Content-Type": "image/jpeg", "X-Request-Timeout-Ms": value}),
                    await client.post(f"/classify?timeout_ms={value}", content=photos["coffee.jpg"],
                                      headers={"Content-Type": "image/jpeg"}))

    for r in run(scenario()):
        assert r.status_code == 422 and "timeout" in r.text.lower()


def test_keys_priority_levels_order_the_queue_over_http(tiny_ckpt, photos, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("gold-key name=gold priority=1\nbronze-key name=bronze priority=3\n")
    jpeg = {"Content-Type": "image/jpeg"}

    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1, api_keys_file=str(keys))) as (client, app):
            mv = app.state.gateway.model()
            gate, blocker = await _hold(mv)
            order: list[str] = []

            async def one(who: str, level: int | None = None) -> int:
                path = "/classify" if level is None else "/v2/models/tiny/infer"
                headers = {"X-API-Key": f"{who}-key", **jpeg}
                if level is None:
                    r = await client.post(path, content=photos["coffee.jpg"], headers=headers)
                else:  # a gold request lowering itself to level 5: behind bronze
                    shape = [1, 3, *mv.info.resolution]
                    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": shape,
                                        "data": _x(mv, 0).ravel().tolist()}], "parameters": {"priority": level}}
                    r = await client.post(path, json=body, headers={"X-API-Key": f"{who}-key"})
                order.append(who if level is None else f"{who}@{level}")
                return r.status_code

            jobs = []
            for who, level in [("bronze", None), ("gold", 5), ("bronze", None), ("gold", None), ("gold", None)]:
                jobs.append(asyncio.create_task(one(who, level)))
                n = len(jobs)
                await _until(lambda n=n: mv.runner.depth == n)
            gate.set()
            codes = await asyncio.gather(*jobs)
            await blocker
            return order, codes

    order, codes = run(scenario())
    assert codes == [200] * 5
    assert order == ["gold", "gold", "bronze", "bronze", "gold@5"]


def test_a_batch_holds_one_level_beside_a_more_urgent_one(tiny_ckpt):
    """While level 1 has traffic, level 2 runs one image a batch (level 1's next request waits behind no more).
    The quiet level, and the rows a deadline allows, are tested with a fake clock in tests/runtime/scheduling."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8)) as (_, app):
            mv = app.state.gateway.model()
            gate, blocker = await _hold(mv)
            jobs = [asyncio.create_task(mv.infer(CLASSIFY, _x(mv, i), None, Admission(priority=level)))
                    for i, level in enumerate([2, 1, 2, 1, 2])]
            await _until(lambda: mv.runner.depth == 5)
            gate.set()
            return [r.batch_size for r in await asyncio.gather(blocker, *jobs)]

    assert run(scenario()) == [1, 1, 2, 1, 2, 1]  # the blocker; level 1's two together, then level 2's one by one


def _model_calls(mv) -> list[str]:
    """What the model computes from now on, in the order its thread computes it: "stage" for each step of a staged
    run, "whole" for a batch run whole (the backend's real runs, each logged as it starts)."""
    backend, calls = mv.runner.local, []
    staged, whole = backend.staged, backend.run

    def logged_staged(task, x):
        stages = staged(task, x)
        if stages is None:
            return None

        def steps():
            while True:
                calls.append("stage")
                try:
                    next(stages)
                except StopIteration as done:
                    return done.value
                yield

        return steps()

    def logged_whole(task, x):
        calls.append("whole")
        return whole(task, x)

    backend.staged, backend.run = logged_staged, logged_whole
    return calls


def test_a_less_urgent_batch_gives_its_instance_to_an_urgent_request_between_blocks(tiny_ckpt, tiny_model):
    """One instance: a level-2 batch started while level 1 is active runs in stages; a level-1 request that comes
    meanwhile runs after the stage running then (the stem), before the rest of the level-2 batch, whose answer
    is still the model's."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1)) as (client, app):
            mv = app.state.gateway.model()
            await mv.infer(CLASSIFY, _x(mv, 0), None, Admission(priority=1))  # level 1 has traffic (ACTIVE_S)
            calls = _model_calls(mv)
            gate = threading.Event()
            mv.thread.submit(gate.wait)  # the model thread busy: the staged run's first step waits for it
            try:
                low = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 1), None, Admission(priority=2)))
                await _until(lambda: mv.runner.running == 1)  # its batch started: its first step waits for the thread
                high = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 2), None, Admission(priority=1)))
                await _until(lambda: mv.runner.depth == 1)
            finally:
                gate.set()
            low_result, _ = await asyncio.gather(low, high)
            return calls, low_result, (await client.get("/metrics")).text, _x(mv, 1)

    calls, low_result, text, x = run(scenario())
    depth = len(tiny_model.blocks)
    # level 2's stem, level 1's batch whole, then the rest of level 2: its blocks and its tail
    assert calls == ["stage", "whole", *["stage"] * (depth + 1)]
    assert metric(text, "vit_serve_preempted_total") == 1
    with torch.no_grad():
        want = tiny_model(torch.from_numpy(x)).numpy()
    assert np.abs(low_result.outputs["logits"] - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_a_staged_batch_stops_once_its_requests_have_gone(tiny_ckpt):
    """The client of the only request in a staged batch goes away after the batch started: the run stops after the
    stage running then."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1)) as (_, app):
            mv = app.state.gateway.model()
            await mv.infer(CLASSIFY, _x(mv, 0), None, Admission(priority=1))
            calls = _model_calls(mv)
            gate = threading.Event()
            mv.thread.submit(gate.wait)
            try:
                low = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 1), None, Admission(priority=2)))
                await _until(lambda: mv.runner.running == 1)
                low.cancel()
            finally:
                gate.set()
            await _until(lambda: mv.runner.running == 0)
            await asyncio.sleep(0.2)  # time for steps that should not come
            return calls

    assert run(scenario()) == ["stage"]  # the stem only


@pytest.mark.parametrize(("instances", "largest"), [(1, 4), (2, 2)])
def test_a_burst_is_shared_among_the_instances_free_for_it(tiny_ckpt, instances, largest):
    """Four requests waiting when the instances come free: one batch of four with one instance; with two, the
    first batch takes two, the rest go to the other instance (two, or one and one if the first batch has already
    ended by then: a tiny model's batch takes a millisecond), never four in one batch beside an idle instance (on
    a CPU a batch's time grows with its rows: the last answer would wait longer)."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8, instances=instances)) as (_, app):
            mv = app.state.gateway.model()
            await mv.infer(CLASSIFY, _x(mv, 0), None, Admission())  # the runner's estimate of a batch's time
            gate = threading.Event()
            try:
                for _ in range(instances):  # every model thread waits for the gate
                    mv.thread.submit(gate.wait)
                blockers = []
                for i in range(instances):  # and every instance holds a batch that waits for a thread
                    blockers.append(asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 90 + i), None, Admission())))
                    await _until(lambda n=i + 1: mv.runner.running == n)
                jobs = [asyncio.create_task(mv.infer(CLASSIFY, _x(mv, i), None, Admission())) for i in range(4)]
                await _until(lambda: mv.runner.depth == 4)
            finally:
                gate.set()
            await asyncio.gather(*blockers)
            return [r.batch_size for r in await asyncio.gather(*jobs)]

    sizes = run(scenario())
    assert max(sizes) == largest and sizes[:largest] == [largest] * largest  # the first batch: `largest` rows
