"""vit_serve.deploy.ray serving a RoPE checkpoint on a real local Ray cluster (`ray.init(num_cpus=2)`, Ray Serve's
own HTTP proxy on a free port): a timm DINOv3 (random weights, tiny widths, converted from the hub folder timm
writes; RoPE only, its embedding the [class] token). `POST /embed` through the proxy and a model replica equals
timm's [class] token after the final norm on the pixels `vit_serve.preprocess` makes of the upload."""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from rope_models import dinov3_hub

import vit_serve
from vit_serve.checkpoints import convert
from vit_serve.preprocess import preprocess
from vit_serve.tune.server_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
timm = pytest.importorskip("timm")
skimage_data = pytest.importorskip("skimage.data")


def test_ray_serves_a_dinov3_embedding(tmp_path):
    from vit_serve.deploy.ray import run, start_ray
    from vit_serve.serve.settings import ServeSettings

    ref = dinov3_hub(tmp_path / "hub", seed=11)
    ckpt = tmp_path / "repo" / "dinov3.safetensors"
    convert(tmp_path / "hub", ckpt)
    buf = io.BytesIO()
    Image.fromarray(skimage_data.chelsea()).save(buf, format="PNG")
    photo = buf.getvalue()

    port = free_port()
    settings = ServeSettings.of({"model": str(ckpt.parent), "default_model": "dinov3", "device": "cpu",
                                 "threads": 1, "decode_workers": 1, "decode": "contract", "port": port})
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        run(settings, blocking=False, num_replicas=1, ray_actor_options={"num_cpus": 0.5}, ingress_replicas=1,
            ingress_actor_options={"num_cpus": 0.5})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240  # Ray and Serve alone can take a minute on a busy machine
        while httpx.get(f"{url}/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the application did not become ready"
            time.sleep(0.2)
        r = httpx.post(f"{url}/embed", files={"file": ("chelsea.png", photo)}, timeout=60)
    finally:
        serve.shutdown()
        ray.shutdown()
    assert r.status_code == 200, r.text
    x = preprocess(photo, vit_serve.load(ckpt).preprocess_cfg)[None]
    with torch.no_grad():
        want = ref.forward_features(x)[0, 0].numpy()
    err = float(np.abs(np.asarray(r.json()["embedding"]) - want).max())
    print(f"Ray Serve, DINOv3 /embed: |Δ| against timm's [class] token {err:.2e}")
    assert err <= 1e-4 and r.json()["dim"] == 96
