"""The direct runner (a server that batches): parts of at most max_batch rows, at most max_queue outstanding."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scheduling_fakes import image

from vit_serve.runtime.backends.base import CallOptions, RemoteBackend
from vit_serve.runtime.scheduling import DirectRunner, FakeClock, QueueFullError, Ticket
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import CLASSIFY, Task


class HeldServer(RemoteBackend):
    """A model server that answers each call when the test releases it; `options` logs what each call carried."""

    name = "held"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.options: list[CallOptions] = []

    async def run(self, task: Task, x: np.ndarray, options: CallOptions | None = None) -> dict[str, np.ndarray]:
        self.options.append(options)
        await self.release.wait()
        return {"logits": x[:, 0, 0, :1].copy()}

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("rows, max_batch, max_queue, outcome, calls", [
    (5, 2, 8, "ok", 3),  # parts of two rows, answered joined
    (5, 2, 2, "QueueFullError", 0),  # three parts: more than may be outstanding
    (1, 2, 1, "ok", 1),
])
def test_a_request_is_sent_in_parts_within_the_outstanding_limit(rows, max_batch, max_queue, outcome, calls):
    async def scenario():
        server = HeldServer()
        runner = DirectRunner(server, RunnerLimits(max_batch=max_batch, max_queue=max_queue), None, None,
                              FakeClock(5.0))
        task = asyncio.create_task(runner.submit(CLASSIFY, image(0, rows), None,
                                                 Ticket(arrived=5.0, deadline=6.0, priority=3)))
        for _ in range(20):
            await asyncio.sleep(0)
        outstanding = runner.depth
        server.release.set()
        try:
            result = await task
        except QueueFullError as e:
            return e.retry_after, outstanding, server.options, None
        return "ok", outstanding, server.options, result

    got, outstanding, options, result = asyncio.run(scenario())
    assert (got if got == "ok" else "QueueFullError") == outcome
    assert outstanding == calls and len(options) == calls
    if result is not None:
        assert result.outputs["logits"][:, 0].tolist() == list(range(rows))
        assert options[0] == CallOptions(1.0, 3)  # the deadline left on the runner's clock, the level
