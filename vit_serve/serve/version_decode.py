"""How one loaded version decodes uploads (`VersionDecoder`): in the gateway's shared decode pool with the
version's own preprocessing contract, or (on CUDA, `gpu_decode`) JPEGs batched on the GPU.

The crop kept for `GET /explain` is stored under the caller's slot for the image (`stores.secret`) and the contract:
two models with different resolutions keep different crops of the same upload, and versions with equal contracts
share theirs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from vit_serve.preprocess import PreprocessConfig
from vit_serve.runtime import decode as decoding
from vit_serve.runtime.decode import Decoded
from vit_serve.runtime.gpu_decode import GpuDecoder
from vit_serve.serve.stores import CropStore, Namespaced
from vit_serve.serve.stores.secret import StoreSecret


def contract_key(preprocess: PreprocessConfig) -> str:
    """A short digest of the preprocessing contract: crops made with equal contracts are interchangeable."""
    text = json.dumps(preprocess.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class VersionDecoder:
    """A version's decoding: `preprocess` (its contract), the gateway's `pool` and crop `store`, the pixel cap, and
    its GPU decoder (`gpu`; None: the CPU path, `gpu_decode_off` saying why); `patch_size`: its model's (NaFlex
    inputs are cut into patches of it)."""

    def __init__(self, preprocess: PreprocessConfig, pool: ThreadPoolExecutor, store: CropStore, max_pixels: int,
                 gpu: GpuDecoder | None = None, gpu_decode_off: str | None = None, patch_size: int = 16) -> None:
        self.preprocess, self.pool, self.max_pixels = preprocess, pool, max_pixels
        self.patch_size = patch_size
        self.gpu, self.gpu_decode_off = gpu, gpu_decode_off
        self.secret: StoreSecret = store.secret  # the caller's slot and id of an image
        self.contract = contract_key(preprocess)
        self.crops = Namespaced(store, self.contract)  # this contract's crops

    def crop_of(self, slot: str) -> Image.Image | None:
        """The model-input crop of an image decoded earlier with this contract, by its slot (`stores.secret`: the
        caller's scope and the id), or None (503 when the store cannot be reached: stores.StoreUnavailableError)."""
        return self.crops.find(slot)

    async def decode(self, data: bytes, key: str | None = None, keep: bool = True) -> Decoded:
        """Upload bytes -> id, crop, x [1, 3, H, W], decoded once (none if the crop is in the store); keeps the
        crop for GET /explain under `key`, the caller's slot for the upload (the id is the key then)."""
        loop = asyncio.get_running_loop()
        cfg = self.preprocess
        if self.gpu is None:
            return await loop.run_in_executor(self.pool, self._decode_kept, data, key, keep)
        t0 = time.perf_counter()
        if not key and keep:
            key = await loop.run_in_executor(self.pool, decoding.image_id, data)
        crop = self.crops.get(key) if keep else None  # a store that cannot answer is a miss here
        if crop is None:
            crop = await self.gpu.crop(data)
            if crop is None:  # not for the GPU: the CPU path (and its 4xx answers)
                crop = await loop.run_in_executor(self.pool, decoding.decode_crop, data, cfg, self.max_pixels)
            if keep:
                self.crops.put(key, crop)
        x = await loop.run_in_executor(self.pool, decoding.input_tensor, crop, cfg)
        return Decoded(key or "", crop, x, (time.perf_counter() - t0) * 1e3)

    def _decode_kept(self, data: bytes, key: str | None, keep: bool) -> Decoded:
        """The CPU path, in the decode pool: the crop from the store (`keep`), else decoded and stored. `key`: the
        bytes' sha256 hex or the caller's slot when the reader has it (`uploads.read_image` hashes while reading),
        else the bytes' id made here when the crop is kept (without keeping, nothing needs the id: it is "")."""
        t0 = time.perf_counter()
        key = key or (decoding.image_id(data) if keep else "")
        crop = self.crops.get(key) if keep else None
        decoded = decoding.decode(data, self.preprocess, self.max_pixels, key, crop)
        if keep and crop is None:
            self.crops.put(key, decoded.crop)
        return dataclasses.replace(decoded, decode_ms=(time.perf_counter() - t0) * 1e3)

    async def decode_naflex(self, data: bytes, max_patches: int, key: str = "") -> Decoded:
        """Upload bytes -> the NaFlex input of `max_patches` patches (`decode.decode_naflex_upload`), in the decode
        pool; nothing is kept (the store's crops are the fixed-size contract's)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, decoding.decode_naflex_upload, data, self.preprocess, self.max_pixels, self.patch_size,
            max_patches, key)

    async def tensor_of(self, crop: Image.Image) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.pool, decoding.input_tensor, crop,
                                                                self.preprocess)

    async def overlay(self, crop: Image.Image, heatmap: np.ndarray, alpha: float, colormap: str,
                      size: int | None = None) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self.pool, decoding.overlay_png, crop, heatmap, alpha,
                                                                colormap, size)

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
