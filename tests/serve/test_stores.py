"""vit_serve.serve.stores against a real Redis server (Debian's `redis-server`, started here on a free port):
crops round-trip exactly (compared with `vit_serve.preprocess` and read back with redis-py) and expire; an image
classified by one gateway process is explained by another (two processes, the second a real `vit-serve serve`);
the memory store cannot do that; a Redis that is down fails no classification; POST /classify?explain=true is
one pass through the explain graph and equals POST /classify and GET /explain (and `vit_serve.explain.rollout`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import metric, run, serving, settings_for
from PIL import Image

from vit_serve.explain import rollout
from vit_serve.preprocess import load_image, preprocess, resize_and_crop, to_tensor
from vit_serve.tune.server_process import ServerProcess, free_port

JPEG = {"Content-Type": "image/jpeg"}


def _crop(data: bytes, cfg) -> Image.Image:
    return resize_and_crop(load_image(data, cfg=cfg), cfg)


# ---- the store -----------------------------------------------------------------------------------------------


def test_redis_store_round_trips_crops_exactly_and_expires(redis_url, tiny_model, photos):
    import redis

    from vit_serve.serve.stores import Namespaced
    from vit_serve.serve.stores.redis import PREFIX, RedisStore
    from vit_serve.serve.stores.secret import StoreSecret

    cfg = tiny_model.preprocess_cfg
    secret = StoreSecret.of(b"a store secret for this test only")
    rejected = []
    store = RedisStore(redis_url, size=8, ttl_s=0.5, secret=secret, rejected=lambda: rejected.append(1))
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
    assert len(raw.get(PREFIX + "noise")) == 8 + 224 * 224 * 3 + 32  # header + raw RGB + seal
    raw.set(PREFIX + "foreign", b"not a crop")
    assert store.find("foreign") is None  # another program's key under our prefix is a miss, not a 500
    assert rejected == [1]  # and counted
    other = RedisStore(redis_url, size=8, ttl_s=60, secret=StoreSecret.of(b"another secret, another gateway"))
    assert other.find("noise") is None  # sealed with another secret: not a crop there

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

    RedisStore(redis_url, size=0, ttl_s=60, secret=secret).put("none", photo)  # size 0 keeps none, as in memory
    RedisStore(redis_url, size=8, ttl_s=60, secret=secret, max_entry_bytes=224 * 224 * 3).put("big", noise)
    assert not raw.exists(PREFIX + "none") and not raw.exists(PREFIX + "big")
    raw.close()


def test_open_store_names_what_it_accepts():
    from vit_serve.serve.stores import open_store
    from vit_serve.serve.stores.memory import MemoryStore

    assert isinstance(open_store(settings_for("m.safetensors")), MemoryStore)
    with pytest.raises(ValueError, match="must be 'memory' or a Redis URL"):
        open_store(settings_for("m.safetensors", store="memcached://x"))


# ---- across gateway processes --------------------------------------------------------------------------------


def _serve_process(model: Path, store: str, **env: str) -> ServerProcess:
    """`vit-serve serve MODEL --port PORT` in its own process, store and test settings from VIT_SERVE_*."""
    env = {"VIT_SERVE_STORE": store, "VIT_SERVE_DECODE": "contract", "VIT_SERVE_DEVICE": "cpu",
           "VIT_SERVE_THREADS": "1", "VIT_SERVE_DECODE_WORKERS": "1", "OMP_NUM_THREADS": "1", **env}
    return ServerProcess.serve([str(model)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_explain_by_id_on_another_gateway_process_with_redis(redis_with_password, tiny_ckpt, photos, tmp_path,
                                                             caplog):
    """Classify in this process, explain by id in a second gateway process (a real `vit-serve serve`), both with
    the Redis password and the store secret from files, as two pods mount them: 200 and the same map as here. A
    third gateway without the secret does not know the id (404), and said so at start, in one warning line."""
    url, password, _ = redis_with_password
    (tmp_path / "password").write_text(password + "\n")
    (tmp_path / "secret").write_text("a store secret shared by the replicas, 32+ bytes\n")
    files = {"store_password_file": str(tmp_path / "password"), "store_secret_file": str(tmp_path / "secret")}
    server = _serve_process(tiny_ckpt, url, **{f"VIT_SERVE_{k.upper()}": v for k, v in files.items()})
    other = server.url
    try:
        try:
            server.wait_ready(120)
        except (RuntimeError, TimeoutError):
            server.proc.kill()
            raise RuntimeError(f"the gateway process did not become ready: "
                               f"{server.proc.communicate()[1].decode()[-2000:]}") from None

        async def scenario():
            async with serving(settings_for(tiny_ckpt, store=url, **files)) as (client, _):
                classified = await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
                image_id = classified.json()["id"]
                here = await client.get(f"/explain?id={image_id}&format=json")
            async with serving(settings_for(tiny_ckpt, store=url, store_password_file=files["store_password_file"])
                               ) as (client, _):
                unkeyed = await client.get(f"/explain?id={image_id}&format=json")
            return image_id, here, unkeyed

        with caplog.at_level("WARNING", logger="vit_serve.serve"):
            image_id, here, unkeyed = run(scenario())
        there = httpx.get(f"{other}/explain?id={image_id}&format=json", timeout=60)
        png = httpx.get(f"{other}/explain?id={image_id}", timeout=60)
    finally:
        server.stop()
    assert here.status_code == 200, here.text
    assert there.status_code == 200, there.text
    assert there.json()["map"] == here.json()["map"] and there.json()["id"] == image_id
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert unkeyed.status_code == 404
    (warning,) = [r.getMessage() for r in caplog.records if "VIT_SERVE_STORE_SECRET" in r.getMessage()]
    assert "\n" not in warning and "other replicas" in warning


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
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
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


# ---- entries cannot be forged or moved; the store's secrets stay out of messages -----------------------------


def _crop_keys(client) -> list[bytes]:
    from vit_serve.serve.stores.redis import PREFIX

    return sorted(client.keys(f"{PREFIX}*"))


def test_a_forged_or_moved_entry_is_ignored_and_counted(redis_with_password, tiny_ckpt, photos):
    """Another program with write access to Redis writes a crop of its own under the gateway's key (redis-py,
    the entry layout the gateway wrote before entries were sealed), and copies one image's entry under another
    image's key: GET /explain?id= answers 404 for both (the entry is ignored, not explained), each read counts in
    vit_serve_store_rejected_total, and a repeated upload decodes again and replaces the entry. Reference: the
    gateway's own answer before the entries were touched."""
    from vit_serve.serve.stores.redis import HEADER

    url, password, raw = redis_with_password
    raw.flushdb()
    store = url.replace("redis://", f"redis://:{password}@")
    coffee, chelsea = photos["coffee.jpg"], photos["chelsea.jpg"]
    forged = Image.fromarray(np.full((32, 48, 3), 7, np.uint8))
    forged_bytes = HEADER.pack(b"VSC1", 48, 32) + forged.tobytes()

    async def scenario():
        async with serving(settings_for(tiny_ckpt, store=store)) as (client, _):
            ida = (await client.post("/classify", content=coffee, headers=JPEG)).json()["id"]
            before = await client.get(f"/explain?id={ida}&format=json")
            (key_a,) = _crop_keys(raw)
            idb = (await client.post("/classify", content=chelsea, headers=JPEG)).json()["id"]
            (key_b,) = [k for k in _crop_keys(raw) if k != key_a]
            m0 = metric((await client.get("/metrics")).text, "vit_serve_store_rejected_total")
            raw.set(key_a, forged_bytes, px=60_000)  # a crop of the attacker's, in the old layout
            forged_answer = await client.get(f"/explain?id={ida}&format=json")
            m1 = metric((await client.get("/metrics")).text, "vit_serve_store_rejected_total")
            raw.set(key_a, raw.get(key_b), px=60_000)  # chelsea's sealed entry moved under coffee's key
            moved_answer = await client.get(f"/explain?id={ida}&format=json")
            m2 = metric((await client.get("/metrics")).text, "vit_serve_store_rejected_total")
            again = await client.post("/classify", content=coffee, headers=JPEG)  # decodes, stores a sealed crop
            after = await client.get(f"/explain?id={ida}&format=json")
            m3 = metric((await client.get("/metrics")).text, "vit_serve_store_rejected_total")
            by_b = await client.get(f"/explain?id={idb}&format=json")
            return before, forged_answer, moved_answer, again, after, by_b, (m0, m1, m2, m3)

    before, forged_answer, moved_answer, again, after, by_b, (m0, m1, m2, m3) = run(scenario())
    assert before.status_code == 200, before.text
    assert forged_answer.status_code == 404, forged_answer.text[:200]
    assert moved_answer.status_code == 404, moved_answer.text[:200]
    assert (m0, m1, m2) == (0, 1, 2)
    assert again.status_code == 200 and m3 == 3  # the repeated upload met the moved entry once more, then decoded
    assert after.status_code == 200 and after.json()["map"] == before.json()["map"]
    assert by_b.status_code == 200  # chelsea's own entry is untouched


def test_the_redis_password_is_read_from_a_file(redis_with_password, tiny_ckpt, photos, tmp_path):
    """A redis-server with --requirepass, the gateway's URL without a password and VIT_SERVE_STORE_PASSWORD_FILE
    (a Kubernetes Secret mount, trailing newline included): classify stores the crop (seen with an authenticated
    redis-py client) and GET /explain?id= answers 200; without the file Redis refuses the gateway (503)."""
    url, password, raw = redis_with_password
    raw.flushdb()
    secret = tmp_path / "password"
    secret.write_text(password + "\n")

    async def scenario(**kw):
        async with serving(settings_for(tiny_ckpt, store=url, **kw)) as (client, _):
            image_id = (await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)).json()["id"]
            return await client.get(f"/explain?id={image_id}&format=json")

    with_file = run(scenario(store_password_file=str(secret)))
    assert with_file.status_code == 200, with_file.text
    assert len(_crop_keys(raw)) == 1
    without = run(scenario())
    assert without.status_code == 503 and password not in without.text


def test_a_password_in_the_file_and_in_the_url_is_refused(tmp_path):
    from vit_serve.serve.stores import open_store

    secret = tmp_path / "password"
    secret.write_text("from-the-file")
    with pytest.raises(ValueError, match="store_password_file") as e:
        open_store(settings_for("m.safetensors", store="redis://:in-the-url@127.0.0.1:1/0",
                                store_password_file=str(secret)))
    assert "in-the-url" not in str(e.value) and "from-the-file" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read") as e:
        open_store(settings_for("m.safetensors", store="redis://127.0.0.1:1/0",
                                store_password_file=str(tmp_path / "missing")))


@pytest.mark.parametrize("url", ["redis://127.0.0.1:{port}/0?password=s3cret-in-query",
                                 "redis://gateway:s3cret-in-netloc@127.0.0.1:{port}/0",
                                 "redis://127.0.0.1:{port}/0?db=0&password=s3cret-in-query&socket_keepalive=1",
                                 "redis://:s3cret-in-netloc@127.0.0.1:{port}/0?password=s3cret-in-query",
                                 "redis://127.0.0.1:{port}/0?db=0&pass%77ord=s3cret-encoded"])
def test_redis_passwords_are_redacted_in_every_message(url, tiny_ckpt, photos, caplog):
    """`?password=` (which redis-py reads too, also percent-encoded) and user:password@ are redacted: in
    `redacted`, in the settings' repr, in the warnings a Redis that is down makes and in the 503 GET /explain?id=
    answers."""
    from vit_serve.serve.settings import ServeSettings
    from vit_serve.serve.stores.redis import redacted

    url = url.format(port=free_port())  # nothing listens there
    assert "s3cret" not in redacted(url) and "127.0.0.1" in redacted(url)
    assert "s3cret" not in repr(ServeSettings(model="m.onnx", store=url))
    assert "s3cret" not in str(ServeSettings(model="m.onnx", store=url))

    async def scenario():
        async with serving(settings_for(tiny_ckpt, store=url)) as (client, _):
            first = await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
            return await client.get(f"/explain?id={first.json()['id']}&format=json")

    with caplog.at_level("DEBUG", logger="vit_serve"):
        by_id = run(scenario())
    assert by_id.status_code == 503 and "cannot be reached" in by_id.text
    assert "s3cret" not in by_id.text
    assert any("cannot be reached" in r.getMessage() for r in caplog.records)
    assert not [r.getMessage() for r in caplog.records if "s3cret" in r.getMessage()]


def test_the_store_secret_is_checked_and_named_never_shown(tmp_path):
    """A short secret, an unreadable file, or both a file and the variable are refused in one line that names
    where the secret came from and never holds it; the same file gives the same ids (two replicas)."""
    from vit_serve.serve.stores import open_store

    (tmp_path / "short").write_text("s3cret-short\n")
    (tmp_path / "good").write_text("s3cret-long-enough-for-a-store\n")
    refused = {"short file": {"store_secret_file": str(tmp_path / "short")},
               "short variable": {"store_secret": "s3cret-short"},
               "missing file": {"store_secret_file": str(tmp_path / "missing")},
               "both": {"store_secret_file": str(tmp_path / "good"), "store_secret": "s3cret-long-enough-too"}}
    for name, kw in refused.items():
        with pytest.raises(ValueError) as e:
            open_store(settings_for("m.safetensors", **kw))
        message = str(e.value)
        assert "\n" not in message and "s3cret" not in message.replace(str(tmp_path), ""), (name, message)
        assert "VIT_SERVE_STORE_SECRET" in message or str(tmp_path) in message, (name, message)
    one, two = (open_store(settings_for("m.safetensors", store_secret_file=str(tmp_path / "good"))).secret
                for _ in range(2))
    assert one.image_id("scope", "0" * 64) == two.image_id("scope", "0" * 64) != one.image_id("other", "0" * 64)
