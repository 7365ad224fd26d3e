"""NaFlex requests through the gateway's batching runner (transformers #23218 is the bug where an image's output
depends on the others in its batch): a burst of concurrent requests of three photos (portrait, wide, square) at
three patch budgets gives each image the embedding it gets alone, and requests of one budget share batches.
Reference: the same torch backend run on each image alone, and transformers' Siglip2VisionModel."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from naflex_models import aspect_photos, siglip2_tower
from PIL import Image

from vit_serve.checkpoints import convert
from vit_serve.runtime.backends.torch import TorchBackend
from vit_serve.runtime.decode import decode_naflex
from vit_serve.runtime.scheduling import BatchingRunner, NoEvents
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import Task

transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")

BUDGETS = (256, 64, 100)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    root = tmp_path_factory.mktemp("naflex_runtime")
    ref = siglip2_tower(root / "hf", seed=7)
    convert(root / "hf", root / "s2.safetensors")
    return ref, TorchBackend(root / "s2.safetensors")


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_a_burst_of_shapes_and_budgets_answers_each_as_alone(backend):
    ref, be = backend
    photos = aspect_photos()
    pre = be.info.preprocess
    inputs = {(name, n): decode_naflex(_png(px), pre, 10**8, be.info.patch_size, n)
              for name, px in photos.items() for n in BUDGETS}
    alone = {key: be.run(Task("embed", max_patches=key[1]), x)["embedding"][0] for key, x in inputs.items()}
    for (name, n), emb in alone.items():  # each alone is transformers' answer for the same file
        x = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=[photos[name]], return_tensors="pt")
        with torch.no_grad():
            assert np.abs(emb - ref(**x).pooler_output[0].numpy()).max() <= 1e-4

    async def burst():
        limits = RunnerLimits(max_batch=8, max_delay_ms=200, request_timeout_s=60, max_queue=64, instances=1,
                              batch_curve=False)
        with ThreadPoolExecutor(1) as model_thread:
            runner = BatchingRunner(be, limits, NoEvents(), model_thread)
            runner.start()
            keys = list(inputs) * 2  # every request twice, interleaved across budgets
            results = await asyncio.gather(*(runner.submit(Task("embed", max_patches=k[1]), inputs[k])
                                              for k in keys))
            await runner.stop()
        return keys, results

    keys, results = asyncio.run(burst())
    assert max(r.batch_size for r in results) > 1  # they did share batches
    for key, r in zip(keys, results, strict=True):
        assert np.abs(r.outputs["embedding"][0] - alone[key]).max() <= 1e-5, key
