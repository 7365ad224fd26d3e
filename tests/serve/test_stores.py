"""vit_serve.serve.stores against a real Redis server (Debian's `redis-server`, started here on a free port):
crops round-trip exactly (compared with `vit_serve.preprocess` and read back with redis-py) and expire; an image
classified by one gateway process is explained by another (two processes, the second a real `vit-serve serve`);
the memory store cannot do that; a Redis that is down fails no classification; POST /classify?explain=true is
one pass through the explain graph and equals POST /classify and GET /explain (and `vit_serve.explain.rollout`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import metric, run, serving, settings_for, wait_ready
from PIL import Image

from vit_serve.explain import rollout
from vit_serve.preprocess import load_image, preprocess, resize_and_crop, to_tensor

JPEG = {"Content-Type": "image/jpeg"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _crop(data: bytes, cfg) -> Image.Image:
    return resize_and_crop(load_image(data, cfg=cfg), cfg)


# ---- the store -----------------------------------------------------------------------------------------------


def test_redis_store_round_trips_crops_exactly_and_expires(redis_url, tiny_model, photos):
    import redis

    from vit_serve.serve.stores import Namespaced
    from vit_serve.serve.stores.redis import PREFIX, RedisStore

    cfg = tiny_model.preprocess_cfg
    store = RedisStore(redis_url, size=8, ttl_s=0.5)
    photo = _crop(photos["chelsea.jpg"], cfg)
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8))
    store.put("photo", photo)
    store.put("noise", noise)
    for key, crop in (("photo", photo), ("noise", noise)):
        back = store.find(key)
        assert back is not None and back.mode == "RGB" and back.size == crop.size
        assert np.array_equal(np.asarray(back), np.asarray(crop))
        assert torch.equal(to_tensor(back, cfg), to_tensor(crop, cfg))  # the explain input is recomputed exactly
    assert store.find("unknown") is None and store.get("unknown") is None

    raw = redis.Redis.from_url(redis_url)  # the server's own view: one key under our prefix, with its TTL
    assert 0 < raw.pttl(PREFIX + "photo") <= 500
    assert len(raw.get(PREFIX + "noise")) == 8 + 224 * 224 * 3  # header + raw RGB
    raw.set(PREFIX + "foreign", b"not a crop")
    assert store.find("foreign") is None  # another program's key under our prefix is a miss, not a 500

    view = Namespaced(store, "contract")
    view.put("photo", photo)
    assert raw.exists(PREFIX + "photo:contract") and view.find("photo") is not None

    raw.pexpire(PREFIX + "photo", 100)
    assert store.find("photo") is not None and raw.pttl(PREFIX + "photo") > 100  # a hit renews it (GETEX PX)
    deadline = time.monotonic() + 10  # Redis expires it (PX); no timing assertion, only that it goes
    while raw.exists(PREFIX + "photo"):  # watched on the server: a find would renew it
        assert time.monotonic() < deadline, "the entry never expired"
        time.sleep(0.05)
    assert store.find("photo") is None

    RedisStore(redis_url, size=0, ttl_s=60).put("none", photo)  # size 0 keeps none, as in memory
    RedisStore(redis_url, size=8, ttl_s=60, max_entry_bytes=224 * 224 * 3).put("big", noise)  # over the cap
    assert not raw.exists(PREFIX + "none") and not raw.exists(PREFIX + "big")
    raw.close()


def test_open_store_names_what_it_accepts():
    from vit_serve.serve.stores import open_store
    from vit_serve.serve.stores.memory import MemoryStore

    assert isinstance(open_store(settings_for("m.safetensors")), MemoryStore)
    with pytest.raises(ValueError, match="must be 'memory' or a Redis URL"):
        open_store(settings_for("m.safetensors", store="memcached://x"))


# ---- across gateway processes --------------------------------------------------------------------------------


def _serve_process(model: Path, store: str, port: int) -> subprocess.Popen:
    """`vit-serve serve MODEL --port PORT` in its own process, store and test settings from VIT_SERVE_*."""
    env = {**os.environ, "VIT_SERVE_STORE": store, "VIT_SERVE_DECODE": "contract", "VIT_SERVE_DEVICE": "cpu",
           "VIT_SERVE_THREADS": "1", "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "vit_serve.cli", "serve", str(model), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    if not wait_ready(url, lambda: proc.poll() is None, timeout=120, poll=0.1):
        proc.kill()
        raise RuntimeError(f"the gateway process did not become ready: {proc.communicate()[1].decode()[-2000:]}")


def test_explain_by_id_on_another_gateway_process_with_redis(redis_url, tiny_ckpt, photos):
    """Classify in this process, explain by id in a second gateway process: 200 and the same map as here."""
    port = _free_port()
    proc = _serve_process(tiny_ckpt, redis_url, port)
    other = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, other)

        async def scenario():
            async with serving(settings_for(tiny_ckpt, store=redis_url)) as (client, _):
                classified = await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
                image_id = classified.json()["id"]
                here = await client.get(f"/explain?id={image_id}&format=json")
                return image_id, here

        image_id, here = run(scenario())
        there = httpx.get(f"{other}/explain?id={image_id}&format=json", timeout=60)
        png = httpx.get(f"{other}/explain?id={image_id}", timeout=60)
    finally:
        proc.terminate()
        proc.wait(30)
    assert here.status_code == 200, here.text
    assert there.status_code == 200, there.text
    assert there.json()["map"] == here.json()["map"] and there.json()["id"] == image_id
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"


def test_memory_store_does_not_reach_another_gateway(tiny_ckpt, photos):
    """The problem Redis solves: with the memory store, a second gateway does not know the id (404)."""

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (first, _), serving(settings_for(tiny_ckpt)) as (second, _):
            image_id = (await first.post("/classify", content=photos["coffee.jpg"], headers=JPEG)).json()["id"]
            return (await first.get(f"/explain?id={image_id}&format=json"),
                    await second.get(f"/explain?id={image_id}&format=json"))

    here, there = run(scenario())
    assert here.status_code == 200 and there.status_code == 404, there.text


def test_redis_down_fails_no_classification_and_explain_by_id_answers_503(tiny_ckpt, photos, caplog):
    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    data = photos["coffee.jpg"]

    async def scenario():
        async with serving(settings_for(tiny_ckpt, store=url)) as (client, _):
            first = await client.post("/classify", content=data, headers=JPEG)
            again = await client.post("/classify", content=data, headers=JPEG)
            by_id = await client.get(f"/explain?id={first.json()['id']}&format=json")
            upload = await client.post("/explain?format=json", content=data, headers=JPEG)
            return first, again, by_id, upload

    with caplog.at_level("WARNING", logger="vit_serve.serve"):
        first, again, by_id, upload = run(scenario())
    assert first.status_code == 200 and again.status_code == 200, again.text
    assert again.json()["predictions"] == first.json()["predictions"]
    assert by_id.status_code == 503 and by_id.headers["retry-after"] == "1"
    assert f"the image store ({url}) cannot be reached" in by_id.json()["detail"]
    assert upload.status_code == 200  # an upload needs no store
    warnings = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not once per request


# ---- POST /classify?explain=true ------------------------------------------------------------------------------


def test_classify_with_explain_is_one_explain_pass(tiny_ckpt, tiny_model, photos):
    """Equals POST /classify's predictions and GET /explain?format=json's map, and `vit_serve.explain.rollout` on
    the PyTorch model; the model ran one explain batch and no classify batch for it (Prometheus counts)."""
    data = photos["chelsea.jpg"]

    def runs(text: str, task: str) -> float:
        return metric(text, "vit_serve_inference_seconds_count", task=task)

    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (client, _):
            plain = await client.post("/classify?top_k=3", content=data, headers=JPEG)
            before = (await client.get("/metrics")).text
            both = await client.post("/classify?top_k=3&explain=true", content=data, headers=JPEG)
            after = (await client.get("/metrics")).text
            by_id = await client.get(f"/explain?id={plain.json()['id']}&format=json")
            return plain, both, by_id, before, after

    plain, both, by_id, before, after = run(scenario())
    assert plain.status_code == 200 and both.status_code == 200 and by_id.status_code == 200, both.text
    assert "explanation" not in plain.json()
    body = both.json()
    assert [p["index"] for p in body["predictions"]] == [p["index"] for p in plain.json()["predictions"]]
    np.testing.assert_allclose([p["score"] for p in body["predictions"]],
                               [p["score"] for p in plain.json()["predictions"]], rtol=1e-5)
    ex, ref = body["explanation"], by_id.json()
    assert {k: ex[k] for k in ("head_fusion", "discard_ratio", "query", "grid", "map")} == {
        k: ref[k] for k in ("head_fusion", "discard_ratio", "query", "grid", "map")}
    assert ex["method"] == "rollout" and ex["grid"] == [2, 3]
    with torch.no_grad():
        _, attn = tiny_model(preprocess(data, tiny_model.preprocess_cfg)[None], return_attention=True)
    library = rollout(attn, (2, 3), tiny_model.num_prefix_tokens, tiny_model.cfg.pool, "mean", 0.9).map[0].numpy()
    np.testing.assert_allclose(np.array(ex["map"]), library, atol=1e-6)
    assert runs(after, "explain") - runs(before, "explain") == 1
    assert runs(after, "classify") == runs(before, "classify")


def test_classify_with_explain_without_explain_graph_answers_400(tiny_onnx, tmp_path, photos):
    for suffix in (".onnx", ".json"):
        shutil.copy(tiny_onnx.with_suffix(suffix), tmp_path / f"plain{suffix}")

    async def scenario():
        async with serving(settings_for(tmp_path / "plain.onnx")) as (client, _):
            return (await client.post("/classify?explain=true", content=photos["coffee.jpg"], headers=JPEG),
                    await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG))

    explained, plain = run(scenario())
    assert explained.status_code == 400 and "no explain graph" in explained.json()["detail"]
    assert plain.status_code == 200
