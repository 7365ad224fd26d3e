"""What runs after an answer is made (`pipeline.Hook`): the `Server-Timing` header, and the payload sampler's draw.
Each only schedules work or sets a header; the answer never waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from PIL import Image
from starlette.responses import Response

from vit_serve.runtime.postprocess import Ood, Prediction
from vit_serve.serve.admission import Admission
from vit_serve.serve.caller import keys_required
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.middleware import request_id
from vit_serve.serve.pipeline import Answered, Hook

log = logging.getLogger("vit_serve.serve")


def server_timing(response: Response) -> Hook:
    """Set `Server-Timing` on `response` (read, decode_wait, decode, queue, infer, text with labels, total; ms)."""

    def hook(done: Answered) -> None:
        response.headers["Server-Timing"] = done.timings.server_timing()

    return hook


def sampling(gateway: Gateway, admission: Admission) -> Hook:
    """Offer a /classify answer (not one by labels) to the payload sampler, when the gateway has one."""

    def hook(done: Answered) -> None:
        if gateway.sampler is not None and done.job.labels is None:
            offer_sample(gateway, done, done.answer.predictions[0], done.answer.ood,
                         tenant_of(gateway, admission.caller.name))

    return hook


def tenant_of(gateway: Gateway, name: str) -> str:
    """The sampler's tenant column: the name of the key the key check verified (`Admission.caller`), empty when
    the gateway takes no keys."""
    return name if keys_required(gateway.settings.security) else ""


def offer_sample(gateway: Gateway, done: Answered, top1: Prediction, ood: Ood | None, tenant: str = "") -> None:
    """Hand the answer to the payload sampler when its draw keeps it: the crop is encoded as PNG in the decode
    pool, and offered from the event loop once it is (the answer does not wait for either)."""
    from vit_serve.runtime.payload_sampler import Sample, png_bytes

    sampler, flag = gateway.sampler, None if ood is None else ood.flag
    if sampler is None or not sampler.wants(flag):
        return
    rid = request_id.get() if gateway.settings.request_ids else None
    sample = functools.partial(Sample, time=time.time(), model=done.model, version=done.version, request_id=rid,
                               top1_label=top1.label, top1_score=float(top1.score or 0.0),
                               ood_score=None if ood is None else ood.score, ood_flag=flag, tenant=tenant)
    crop: Image.Image = done.crop

    def offer(png: asyncio.Future[bytes]) -> None:
        if png.cancelled():
            return
        if (error := png.exception()) is not None:
            log.warning("payload sampler: the crop could not be encoded: %s", error)
            return
        sampler.offer(sample(crop_png=png.result()))

    with contextlib.suppress(RuntimeError):  # the pool is shut down: the gateway is stopping, no sample
        encoding = asyncio.get_running_loop().run_in_executor(gateway.decode_pool, png_bytes, crop)
        encoding.add_done_callback(offer)
        gateway.pending_samples.add(encoding)  # a graceful stop waits for it (Gateway.stop)
        encoding.add_done_callback(gateway.pending_samples.discard)
