"""The payload sampler in the gateway: each kept request carries its tenant (the name of the key the key check
verified; empty without keys), and samples the sampler drops are counted in /metrics
(vit_serve_samples_dropped_total{reason}). A real app (Starlette's TestClient) over a tiny checkpoint, the samples
read back with pyarrow."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_serve.runtime.payload_sampler import read_samples
from vit_serve.serve.keys import default_name, key_hash
from vit_serve.serve.settings import ServeSettings

pytest.importorskip("pyarrow.parquet")


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_samples_carry_the_verified_tenant(tmp_path: Path, save_tiny, ready_client) -> None:
    """Two keys (one named in the key file, one without a name) and a gateway without keys: each sample's tenant
    is its key's name (the hash's short prefix for the unnamed one), empty without keys; the key itself is
    nowhere in the samples."""
    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, ["a", "b", "c"])
    keys = tmp_path / "keys.txt"
    keys.write_text("alice-secret-key-0001 name=alice\nunnamed-secret-key-0002\n")
    with_keys = tmp_path / "with_keys"
    settings = ServeSettings(model=str(ckpt), device="cpu", threads=1, api_keys_file=str(keys), sample_rate=1.0,
                             sample_dir=str(with_keys))
    with ready_client(settings) as client:
        for i, key in enumerate(("alice-secret-key-0001", "unnamed-secret-key-0002", "alice-secret-key-0001")):
            r = client.post("/classify", files={"file": ("x.png", _png(i), "image/png")}, headers={"X-API-Key": key})
            assert r.status_code == 200, r.text
        r = client.post("/classify", files={"file": ("x.png", _png(9), "image/png")}, headers={"X-API-Key": "nope"})
        assert r.status_code == 401
    rows = read_samples(with_keys).to_pylist()
    assert sorted(r["tenant"] for r in rows) == sorted(["alice", "alice", default_name(key_hash(
        "unnamed-secret-key-0002"))])
    text = b"".join(p.read_bytes() for p in with_keys.iterdir())
    assert b"secret-key" not in text

    without = tmp_path / "without_keys"
    with ready_client(ServeSettings(model=str(ckpt), device="cpu", threads=1, sample_rate=1.0,
                                    sample_dir=str(without))) as client:
        assert client.post("/classify", files={"file": ("x.png", _png(5), "image/png")}).status_code == 200
        assert "vit_serve_samples_dropped_total{" not in client.get("/metrics").text  # nothing dropped yet
    assert [r["tenant"] for r in read_samples(without).to_pylist()] == [""]


def test_dropped_samples_are_counted_in_metrics(tmp_path: Path, save_tiny, ready_client) -> None:
    """A sampler whose writes fail (its folder replaced by a file after start: the write is refused by the OS)
    counts the lost samples in vit_serve_samples_dropped_total{reason="write_failed"}; the answers stay 200."""
    import time

    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, ["a", "b", "c"])
    folder = tmp_path / "samples"
    settings = ServeSettings(model=str(ckpt), device="cpu", threads=1, sample_rate=1.0, sample_dir=str(folder))
    with ready_client(settings) as client:
        sampler = client.app.state.gateway.sampler
        sampler.part_rows = 1
        folder.rmdir()
        folder.write_bytes(b"not a folder")
        assert client.post("/classify", files={"file": ("x.png", _png(1), "image/png")}).status_code == 200
        deadline = time.monotonic() + 20
        while not sampler.stats.failed and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = client.get("/metrics").text
    assert 'vit_serve_samples_dropped_total{reason="write_failed"} 1.0' in metrics


def test_a_crop_still_being_encoded_when_the_gateway_stops_is_written(tmp_path: Path, save_tiny, ready_client,
                                                                       monkeypatch) -> None:
    """The sampler's PNG encoding runs after the answer; a graceful stop right after the last answer (the client
    leaving) waits for it, so that the sample is written, not cancelled with the decode pool."""
    import time

    import vit_serve.runtime.payload_sampler as payload_sampler

    encode = payload_sampler.png_bytes
    monkeypatch.setattr(payload_sampler, "png_bytes", lambda crop: (time.sleep(0.5), encode(crop))[1])
    ckpt = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 0, ["a", "b", "c"])
    folder = tmp_path / "samples"
    with ready_client(ServeSettings(model=str(ckpt), device="cpu", threads=1, sample_rate=1.0,
                                    sample_dir=str(folder))) as client:
        assert client.post("/classify", files={"file": ("x.png", _png(3), "image/png")}).status_code == 200
    assert len(read_samples(folder).to_pylist()) == 1
