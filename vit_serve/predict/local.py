"""The local engine of `vit-serve predict` (`run_local`): files decoded in worker threads (or processes), in order,
a bounded window ahead, each queued on the gateway's scheduler (`vit_serve.runtime.scheduling.BatchingRunner`)
as it is decoded; the runner forms the batches across files and runs them in its model thread; the rows are
written in SRC's order, `batch_size` at a time.

A batch is `batch_size` consecutive readable files (the runner's max_batch), the last one what is left: the
engine announces the rest of SRC as coming (`Arrival`) until its last file is queued, and the runner waits, with
no time limit, for a batch to fill while more is coming. So batches, and therefore the rows' scores, do not depend
on how fast files decode.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING

from vit_serve.predict.batch import Item, Sink, batch_tasks, decode_file, split_outputs
from vit_serve.predict.options import PredictOptions
from vit_serve.runtime.scheduling import BatchingRunner, NoEvents, Result
from vit_serve.runtime.settings import RunnerLimits

if TYPE_CHECKING:
    from vit_serve.preprocess import PreprocessConfig
    from vit_serve.runtime.backends.base import LocalBackend
    from vit_serve.runtime.task import Task

# An offline job has no request to answer in time: a batch waits to fill, and a file to be run, for as long as
# it takes (about 30 years here, finite for the event loop's timers).
NO_LIMIT_S = 1e9

Queued = tuple[Item, list["asyncio.Task[Result]"]]


def run_local(backend: LocalBackend, items: list[Item], sink: Sink, opts: PredictOptions, workers: int) -> None:
    """Predict `items` into `sink`: decode in `workers` threads (or processes) while the model runs batches of
    `opts.batch_size` in its own thread (see the module's docstring). Runs its own event loop (in a thread of its
    own when called from a running one)."""
    job = _job(backend, items, sink, opts, workers)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(job)
    with ThreadPoolExecutor(1, thread_name_prefix="vit-serve-predict-loop") as loop_thread:
        loop_thread.submit(asyncio.run, job).result()


def limits_for(opts: PredictOptions, tasks: int) -> RunnerLimits:
    """The runner's limits for a job: batches of `batch_size`, filled whatever the wait, a queue with room for
    what the engine keeps queued (`queued_max`, for each of the `tasks` an image runs), one instance."""
    return RunnerLimits(max_batch=opts.batch_size, max_delay_ms=NO_LIMIT_S * 1e3, request_timeout_s=NO_LIMIT_S,
                        max_queue=queued_max(opts) * tasks, instances=1, batch_curve=False)


def queued_max(opts: PredictOptions) -> int:
    """Readable files queued on the runner and not yet written: one batch running, the next filling."""
    return 2 * opts.batch_size


async def _job(backend: LocalBackend, items: list[Item], sink: Sink, opts: PredictOptions, workers: int) -> None:
    tasks = batch_tasks(backend.info, opts.embeddings, opts.explain, opts.max_patches)
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="vit-serve-predict-model")
    runner = BatchingRunner(backend, limits_for(opts, len(tasks)), NoEvents(), model_thread)
    if opts.processes:
        pool: Executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    else:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="vit-serve-predict-decode")
    queued: asyncio.Queue[Queued | BaseException | None] = asyncio.Queue()
    room = asyncio.Semaphore(queued_max(opts))
    runner.start()
    feeder = asyncio.get_running_loop().create_task(
        _feed(runner, tasks, items, pool, backend.info.preprocess, sink, opts, 2 * opts.batch_size + workers,
              room, queued))
    try:
        await _write(queued, sink, room, backend, opts)
        await feeder
    finally:
        feeder.cancel()
        while not queued.empty():  # left by a failure: nobody will read their answers
            if isinstance(got := queued.get_nowait(), tuple):
                for run in got[1]:
                    run.cancel()
        await runner.stop()
        model_thread.shutdown(wait=True)
        pool.shutdown(wait=True, cancel_futures=True)


async def _feed(runner: BatchingRunner, tasks: tuple[Task, ...], items: list[Item], pool: Executor,
                cfg: PreprocessConfig, sink: Sink, opts: PredictOptions, ahead: int, room: asyncio.Semaphore,
                queued: asyncio.Queue[Queued | BaseException | None]) -> None:
    """Decode `items` in `pool`, in order, `ahead` at most at once; queue each readable file's tasks on the
    runner (at most `room` files not yet written), in order; report an unreadable one to `sink`. The end (None)
    or the failure goes to `queued` last."""
    loop = asyncio.get_running_loop()
    naflex = None if opts.max_patches is None else (runner.backend.info.patch_size, opts.max_patches)
    todo, window = iter(items), deque()
    rest = runner.arriving()  # the files not yet queued: a batch waits for them to fill
    try:
        while True:
            while len(window) < ahead and (item := next(todo, None)) is not None:
                window.append((item, loop.run_in_executor(pool, decode_file, item.path, cfg, opts.max_pixels, naflex)))
            if not window:
                break
            item, future = window.popleft()
            x, why = await future
            if x is None:
                sink.error(item.path, why or "unreadable")
                continue
            await room.acquire()
            queued.put_nowait((item, [loop.create_task(runner.submit(task, x[None])) for task in tasks]))
            await asyncio.sleep(0)  # the submissions reach the queue, in order, before the next file
        rest.done()
        queued.put_nowait(None)
    except BaseException as e:
        queued.put_nowait(e)
        raise
    finally:
        rest.done()
        for _, future in window:
            future.cancel()


async def _write(queued: asyncio.Queue[Queued | BaseException | None], sink: Sink, room: asyncio.Semaphore,
                 backend: LocalBackend, opts: PredictOptions) -> None:
    """Write the queued files' rows, `batch_size` at a time, in order, as their answers come."""
    group: list[tuple[Item, list[Result]]] = []

    def flush() -> None:
        outputs = [Result.joined([results[t] for _, results in group]).outputs for t in range(len(group[0][1]))]
        sink.batch([item for item, _ in group], *split_outputs(backend.info, opts.embeddings, outputs))
        for _ in group:
            room.release()
        group.clear()

    while (got := await queued.get()) is not None:
        if isinstance(got, BaseException):
            raise got
        item, runs = got
        group.append((item, [await run for run in runs]))
        if len(group) == opts.batch_size:
            flush()
    if group:
        flush()
