"""A model version held still for the cancellation and deadline tests: its single model thread waits on an event,
so one request sits in the running batch and every later one waits in the queue until the gate opens (as in
test_priorities, but for a gateway under a real uvicorn in another thread: `mv.thread` is thread-safe to submit
to, and the runner's counters are plain ints read from here)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from gateway_helpers import live_app, metric, settings_for


class Live(NamedTuple):
    url: str
    grpc: str
    mv: Any  # the served ModelVersion


def live_held(ckpt: Path) -> Iterator[Live]:
    """A real uvicorn (and gRPC on a free port) serving the tiny torch checkpoint, batches of up to 4."""
    with live_app(settings_for(ckpt, max_batch=4, grpc_port=0, request_timeout_s=60)) as (url, app):
        yield Live(url, app.state.grpc.address, app.state.gateway.model())


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll `predicate` every 10 ms; AssertionError after `timeout` seconds."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


class Gate:
    """The version's model thread held on an event (`close`) until `open`."""

    def __init__(self, mv) -> None:
        self.mv = mv
        self.event = threading.Event()

    def close(self) -> None:
        self.mv.thread.submit(self.event.wait)

    def open(self) -> None:
        self.event.set()


class Counts:
    """The gateway's own numbers from its /metrics: images the model ran (the batch_size histograms' sums over
    every task), cancelled requests by stage, deadline refusals."""

    def __init__(self, text: str) -> None:
        self.rows = sum(metric(text, "vit_serve_batch_size_sum", task=t) for t in ("classify", "embed", "explain"))
        self.cancelled = {s: metric(text, "vit_serve_cancelled_total", stage=s)
                          for s in ("read", "decode", "queue", "infer")}
        self.deadline = metric(text, "vit_serve_rejected_total", reason="deadline")

    @staticmethod
    async def of(url: str) -> Counts:
        async with httpx.AsyncClient(timeout=30) as c:
            return Counts((await c.get(f"{url}/metrics")).text)

    def since(self, before: Counts) -> dict[str, float]:
        """What changed: rows run, cancelled (all stages, and per stage where non-zero), deadline refusals."""
        out = {"rows": self.rows - before.rows, "deadline": self.deadline - before.deadline,
               "cancelled": sum(self.cancelled.values()) - sum(before.cancelled.values())}
        out.update({f"cancelled_{s}": v - before.cancelled[s] for s, v in self.cancelled.items()
                    if v != before.cancelled[s]})
        return out


async def hold(live: Live, client: httpx.AsyncClient, image: bytes) -> tuple[Gate, asyncio.Task]:
    """Hold the model thread and put one request (kept) in the running batch: later ones wait in the queue."""
    gate = Gate(live.mv)
    gate.close()
    keeper = asyncio.create_task(client.post(f"{live.url}/classify", content=image,
                                             headers={"Content-Type": "image/jpeg"}))
    await until(lambda: live.mv.runner.running == 1)
    return gate, keeper
