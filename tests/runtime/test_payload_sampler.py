"""vit_serve.runtime.payload_sampler: real Parquet parts read back with pyarrow (the crops are PNGs of
scikit-image's photos, decoded again with PIL), the size cap (unflagged parts evicted first) and the retention,
nothing written when off, the draws' shares (binomial bounds), the full queue's drops, and a real Redis stream
(Debian's redis-server on a free port)."""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vit_serve.runtime.payload_sampler import (
    PART_RE,
    PayloadSampler,
    Sample,
    SamplerSettings,
    list_parts,
    part_name,
    png_bytes,
    read_samples,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
skdata = pytest.importorskip("skimage.data")


@pytest.fixture(scope="module")
def crops() -> list[np.ndarray]:
    """Four 64x64 RGB crops of scikit-image's photos (the model-input crop's role)."""
    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.rocket()]
    return [np.asarray(Image.fromarray(p).resize((64, 64), Image.BICUBIC)) for p in photos]


def make_sample(crop: np.ndarray, i: int, flagged: bool | None, t: float | None = None) -> Sample:
    return Sample(time=time.time() if t is None else t, model="vit-s16", version="3", request_id=f"req-{i}",
                  crop_png=png_bytes(crop), top1_label=f"label-{i % 5}", top1_score=0.5 + i / 1000,
                  ood_score=None if flagged is None else (4.0 + i if flagged else 0.1 * i), ood_flag=flagged)


def decode(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_parts_read_back_with_pyarrow(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """What was offered comes back from the parts, column by column, and the PNGs decode to the crops' pixels;
    flagged and unflagged samples lie in separate parts, named by the sampler's pattern."""
    folder = tmp_path / "samples"
    offered = [make_sample(crops[i % 4], i, [True, False, None][i % 3]) for i in range(12)]
    offered[4] = Sample(**{**offered[4].__dict__, "request_id": None})
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=3) as sampler:
        for s in offered:
            sampler.offer(s)
    assert sampler.stats.written == 12 and sampler.stats.dropped == 0 and sampler.stats.errors == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names and all(PART_RE.match(n) for n in names), names
    for path in folder.iterdir():
        flags = pq.read_table(path).column("ood_flag").to_pylist()
        assert all(f is True for f in flags) if path.name.endswith("-flagged.parquet") else True not in flags

    table = read_samples(folder)
    assert table.column_names == ["time", "model", "version", "request_id", "image", "top1_label", "top1_score",
                                  "ood_score", "ood_flag", "tenant"]
    rows = sorted(table.to_pylist(), key=lambda r: r["top1_score"])
    assert len(rows) == 12
    for s, row in zip(offered, rows, strict=True):
        assert abs(row["time"].timestamp() - s.time) < 2e-6
        assert (row["model"], row["version"], row["request_id"], row["top1_label"]) == (
            s.model, s.version, s.request_id, s.top1_label)
        assert (row["top1_score"], row["ood_score"], row["ood_flag"]) == (s.top1_score, s.ood_score, s.ood_flag)
        assert row["image"] == s.crop_png
        np.testing.assert_array_equal(decode(row["image"]), crops[int(s.top1_score * 1000 - 500) % 4])
    # each file on its own, too (pyarrow.parquet, not the helper)
    assert sum(pq.read_table(p).num_rows for p in folder.iterdir()) == 12


def test_off_writes_nothing(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """rate 0 (the default): no draw says yes, offers are ignored, no folder or thread is created."""
    folder = tmp_path / "never"
    sampler = PayloadSampler(SamplerSettings(rate=0.0, folder=folder, flagged_rate=1.0))
    assert not sampler.enabled and sampler._thread is None
    assert not any(sampler.wants(f) for f in (True, False, None) for _ in range(100))
    sampler.offer(make_sample(crops[0], 0, True))
    sampler.close()
    assert not folder.exists() and not list(tmp_path.iterdir())
    assert sampler.stats.offered == sampler.stats.written == 0
    default = PayloadSampler(SamplerSettings())
    assert not default.enabled and not default.wants(True)
    default.close()


def test_close_flushes(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Below a part's rows and long before its time, close() writes what waits; offers after it are ignored."""
    folder = tmp_path / "s"
    sampler = PayloadSampler(SamplerSettings(rate=0.5, folder=folder), part_rows=1000, part_seconds=3600)
    for i in range(5):
        sampler.offer(make_sample(crops[i % 4], i, i == 2))
    time.sleep(0.1)
    assert list_parts(folder) == []
    sampler.close()
    assert read_samples(folder).num_rows == 5 and len(list_parts(folder)) == 2
    sampler.offer(make_sample(crops[0], 9, False))
    sampler.close()
    assert read_samples(folder).num_rows == 5 and not sampler.wants(False)


def test_part_after_part_seconds(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """A part is written once its oldest sample has waited part_seconds, without close()."""
    folder = tmp_path / "s"
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=1000, part_seconds=0.2) as sampler:
        sampler.offer(make_sample(crops[0], 0, False))
        deadline = time.monotonic() + 10
        while not list_parts(folder) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(list_parts(folder)) == 1 and read_samples(folder).num_rows == 1


def test_cap_evicts_unflagged_first(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Under a cap of a few parts, the folder's parts stay within max_bytes; the unflagged parts go (oldest
    first) while every flagged one stays; with the cap below the flagged parts alone, the oldest flagged go."""
    folder = tmp_path / "s"
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder, max_bytes=10**9), part_rows=1) as probe:
        probe.offer(make_sample(crops[0], 0, False))
    part_bytes = sum(p.stat().st_size for p in list_parts(folder))
    for p in list_parts(folder):
        p.unlink()
    cap = int(part_bytes * 5.5)
    t0 = time.time() - 100
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder, max_bytes=cap), part_rows=1) as sampler:
        for i in range(3):
            sampler.offer(make_sample(crops[0], i, True, t=t0 + i))
        for i in range(3, 13):
            sampler.offer(make_sample(crops[0], i, False, t=t0 + i))
    parts = list_parts(folder)
    assert sum(p.stat().st_size for p in parts) <= cap
    assert sampler.stats.deleted >= 7
    table = read_samples(folder)
    kept = table.column("request_id").to_pylist()
    assert {"req-0", "req-1", "req-2"} <= set(kept)  # every flagged sample kept
    unflagged = [r for r in kept if r not in ("req-0", "req-1", "req-2")]
    assert unflagged and unflagged == [f"req-{i}" for i in range(13 - len(unflagged), 13)]  # the newest kept

    # a cap below the flagged parts: the oldest flagged parts go too (unflagged first, all of them)
    small = SamplerSettings(rate=1.0, folder=folder, max_bytes=int(part_bytes * 1.5))
    PayloadSampler(small).close()  # enforced at start
    assert read_samples(folder).column("request_id").to_pylist() == ["req-2"]


def test_retention(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Parts whose newest sample is older than retention_s are deleted after a write and at start; fresh ones
    stay. The age is the time in the part's name (its newest sample), not the file's mtime."""
    folder = tmp_path / "s"
    now = time.time()
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder, retention_s=86400), part_rows=1) as sampler:
        sampler.offer(make_sample(crops[0], 0, True, t=now - 3 * 86400))  # written, then deleted
        sampler.offer(make_sample(crops[1], 1, False, t=now - 3600))
        sampler.offer(make_sample(crops[2], 2, True, t=now - 60))
    assert read_samples(folder).column("request_id").to_pylist() == ["req-1", "req-2"]
    for p in list_parts(folder):
        os.utime(p, (now - 10 * 86400, now - 10 * 86400))  # mtime does not count
    PayloadSampler(SamplerSettings(rate=1.0, folder=folder, retention_s=86400)).close()
    assert len(list_parts(folder)) == 2
    # a restart with a shorter retention: the hour-old part goes at start
    PayloadSampler(SamplerSettings(rate=1.0, folder=folder, retention_s=600)).close()
    assert read_samples(folder).column("request_id").to_pylist() == ["req-2"]


def test_never_deletes_foreign_files(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Files that do not carry the sampler's name pattern are neither counted nor deleted, however old or
    large; so are parts-like names that differ (another extension, a subfolder)."""
    folder = tmp_path / "s"
    folder.mkdir()
    old = time.time() - 365 * 86400
    foreign = {
        "labels.csv": b"x" * 50_000,
        "part-notes.parquet": b"y" * 50_000,
        part_name(old, 1, "abcdef01", False) + ".bak": b"z" * 50_000,
        "part-20000101T000000.000000Z-000001-abcdef01-normal.parquet.orig": b"w" * 10,
    }
    for name, data in foreign.items():
        (folder / name).write_bytes(data)
        os.utime(folder / name, (old, old))
    (folder / "sub").mkdir()
    (folder / "sub" / part_name(old, 1, "abcdef01", False)).write_bytes(b"v")
    settings = SamplerSettings(rate=1.0, folder=folder, max_bytes=1000, retention_s=1)
    with PayloadSampler(settings, part_rows=1) as sampler:
        for i in range(4):
            sampler.offer(make_sample(crops[i % 4], i, i % 2 == 0, t=old))
    assert list_parts(folder) == []  # its own parts: too old and over the cap
    for name, data in foreign.items():
        assert (folder / name).read_bytes() == data
    assert (folder / "sub" / part_name(old, 1, "abcdef01", False)).exists()


def binomial_ok(hits: int, n: int, p: float) -> bool:
    """`hits` within 5 standard deviations of n * p."""
    return abs(hits - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


def test_rates_within_binomial_bounds(tmp_path: Path) -> None:
    """Over 2000 draws each (seeded), rate's and flagged_rate's shares lie within binomial bounds; the same seed
    draws the same; rate 1 always says yes, flagged_rate 0 never does for flagged requests."""
    n = 2000
    settings = SamplerSettings(rate=0.05, folder=tmp_path / "s", flagged_rate=0.6)
    with PayloadSampler(settings, seed=1) as a, PayloadSampler(settings, seed=1) as b:
        draws = [a.wants(None) for _ in range(n)]
        assert draws == [b.wants(None) for _ in range(n)]
        assert binomial_ok(sum(draws), n, 0.05)
        assert binomial_ok(sum(a.wants(False) for _ in range(n)), n, 0.05)
        assert binomial_ok(sum(a.wants(True) for _ in range(n)), n, 0.6)
    with PayloadSampler(SamplerSettings(rate=1.0, folder=tmp_path / "s", flagged_rate=0.0), seed=2) as c:
        assert all(c.wants(False) for _ in range(200)) and not any(c.wants(True) for _ in range(200))


def test_full_queue_drops_unflagged_first(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """With the writer held back, a full queue drops the oldest unflagged samples for new ones, an unflagged
    sample when only flagged ones wait, and a flagged one only when all are flagged; the drops are counted."""
    folder = tmp_path / "s"
    sampler = PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=100, part_seconds=3600,
                             queue_size=6)
    with sampler._cond:  # the writer cannot take anything until this block ends
        for i in range(6):  # 2 flagged, 4 unflagged: full
            sampler.offer(make_sample(crops[i % 4], i, i < 2))
        for i in range(6, 10):  # 4 flagged: each drops the oldest unflagged
            sampler.offer(make_sample(crops[i % 4], i, True))
        assert sampler.stats.dropped == 4 and sampler.stats.dropped_flagged == 0
        sampler.offer(make_sample(crops[0], 10, False))  # only flagged wait: the new unflagged one is dropped
        sampler.offer(make_sample(crops[0], 11, True))  # all flagged: the oldest flagged goes
        assert sampler.stats.dropped == 6 and sampler.stats.dropped_flagged == 1
    sampler.close()
    ids = sorted(read_samples(folder).column("request_id").to_pylist(), key=lambda r: int(r.split("-")[1]))
    assert ids == ["req-1", "req-6", "req-7", "req-8", "req-9", "req-11"]
    assert sampler.stats.written == 6


def test_offer_never_blocks(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """A thousand offers into a small queue return at once (drops instead of waiting)."""
    sample = make_sample(crops[0], 0, False)
    with PayloadSampler(SamplerSettings(rate=1.0, folder=tmp_path / "s"), part_rows=8, queue_size=8) as sampler:
        start = time.perf_counter()
        for _ in range(1000):
            sampler.offer(sample)
        assert time.perf_counter() - start < 1.0
    assert sampler.stats.written + sampler.stats.dropped == 1000


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate": 1.5, "folder": Path("x")}, "rate must be a number from 0 to 1"),
    ({"rate": -0.1}, "rate must be a number from 0 to 1"),
    ({"flagged_rate": 2.0}, "flagged_rate must be a number from 0 to 1"),
    ({"max_bytes": 0}, "max_bytes must be a positive integer"),
    ({"retention_s": 0}, "retention_s must be a positive number"),
    ({"rate": 0.1}, "either a folder (--sample-dir) or a Redis URL, not neither"),
    ({"rate": 0.1, "folder": Path("x"), "redis_url": "redis://h"}, "not both"),
    ({"redis_maxlen": 0}, "redis_maxlen must be a positive integer"),
])
def test_validation(kwargs: dict[str, Any], message: str) -> None:
    """Bad settings fail with one clear line."""
    with pytest.raises(ValueError, match="payload sampler") as err:
        SamplerSettings(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def redis_stream_server(tmp_path_factory, start_redis) -> Iterator[tuple[str, Any]]:
    """A real redis-server (no persistence; small stream nodes, so that `MAXLEN ~` trims at a few entries)."""
    with start_redis(tmp_path_factory.mktemp("redis"), "--save", "", "--appendonly", "no",
                     "--stream-node-max-entries", "4") as server:
        yield server


def test_redis_stream(redis_stream_server: tuple[str, Any], crops: list[np.ndarray], tmp_path: Path) -> None:
    """In Redis mode each sample is one XADD; XRANGE reads back the fields (the PNG bytes decode to the crop),
    the unknown ones absent; no folder is written."""
    url, client = redis_stream_server
    stream = "test:samples"
    client.delete(stream)
    offered = [make_sample(crops[i % 4], i, [True, False, None][i % 3]) for i in range(7)]
    offered[1] = Sample(**{**offered[1].__dict__, "request_id": None})
    with PayloadSampler(SamplerSettings(rate=1.0, redis_url=url, redis_stream=stream), part_rows=3) as sampler:
        for s in offered:
            sampler.offer(s)
    assert sampler.stats.written == 7 and sampler.stats.errors == 0
    entries = client.xrange(stream)  # flagged and unflagged batches are sent apart: order by top1_score
    assert len(entries) == 7
    for s, (_, fields) in zip(offered, sorted(entries, key=lambda e: float(e[1][b"top1_score"])), strict=True):
        assert float(fields[b"time"]) == s.time and fields[b"model"] == b"vit-s16" and fields[b"version"] == b"3"
        assert fields.get(b"request_id") == (None if s.request_id is None else s.request_id.encode())
        assert fields[b"top1_label"] == s.top1_label.encode() and float(fields[b"top1_score"]) == s.top1_score
        assert fields.get(b"ood_score") == (None if s.ood_score is None else repr(s.ood_score).encode())
        assert fields.get(b"ood_flag") == {None: None, True: b"1", False: b"0"}[s.ood_flag]
        assert fields[b"flagged"] == (b"1" if s.ood_flag is True else b"0")
        assert fields[b"image"] == s.crop_png
        np.testing.assert_array_equal(decode(fields[b"image"]), crops[int(s.top1_score * 1000 - 500) % 4])
    assert list(tmp_path.iterdir()) == []


def test_redis_maxlen(redis_stream_server: tuple[str, Any], crops: list[np.ndarray]) -> None:
    """The stream is trimmed (MAXLEN ~): by redis_maxlen, or by max_bytes over the mean entry size; the newest
    entries stay."""
    url, client = redis_stream_server
    for stream, settings in [
        ("test:maxlen", SamplerSettings(rate=1.0, redis_url=url, redis_stream="test:maxlen", redis_maxlen=8)),
        ("test:bytes", SamplerSettings(rate=1.0, redis_url=url, redis_stream="test:bytes",
                                       max_bytes=8 * len(png_bytes(crops[0])))),
    ]:
        client.delete(stream)
        with PayloadSampler(settings, part_rows=5) as sampler:
            for i in range(60):
                sampler.offer(make_sample(crops[0], i, False))
        length = client.xlen(stream)
        assert 1 <= length <= 8 + 4, (stream, length)  # approximate: up to a stream node over
        last = client.xrevrange(stream, count=1)[0][1]
        assert last[b"request_id"] == b"req-59"


def test_redis_off_connects_nowhere(crops: list[np.ndarray]) -> None:
    """rate 0 with a Redis URL: no client, nothing sent (an unreachable URL raises nothing)."""
    sampler = PayloadSampler(SamplerSettings(rate=0.0, redis_url="redis://127.0.0.1:1/0"))
    sampler.offer(make_sample(crops[0], 0, True))
    sampler.close()
    assert sampler._redis is None and sampler.stats.written == 0


def test_redis_unreachable_is_counted(crops: list[np.ndarray]) -> None:
    """Redis away: offer still returns at once, the batch is lost and counted, close() returns."""
    settings = SamplerSettings(rate=1.0, redis_url="redis://127.0.0.1:1/0")
    with PayloadSampler(settings, part_rows=2) as sampler:
        for i in range(4):
            sampler.offer(make_sample(crops[0], i, False))
    assert sampler.stats.written == 0 and sampler.stats.failed == 4 and sampler.stats.errors == 2


def test_redis_batch_after_part_seconds(redis_stream_server: tuple[str, Any], crops: list[np.ndarray]) -> None:
    """In Redis mode too, a lone sample is sent once it has waited part_seconds, without close()."""
    url, client = redis_stream_server
    stream = "test:timer"
    client.delete(stream)
    settings = SamplerSettings(rate=1.0, redis_url=url, redis_stream=stream)
    with PayloadSampler(settings, part_rows=1000, part_seconds=0.2) as sampler:
        time.sleep(0.3)  # the writer is waiting with nothing queued
        sampler.offer(make_sample(crops[0], 0, False))
        deadline = time.monotonic() + 10
        while not client.xlen(stream) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.xlen(stream) == 1


def test_redis_retention(redis_stream_server: tuple[str, Any], crops: list[np.ndarray]) -> None:
    """Entries older than retention_s (by their stream ID, a millisecond time) are trimmed (MINID ~) when the
    sampler sends; the new ones stay."""
    url, client = redis_stream_server
    stream = "test:retention"
    client.delete(stream)
    old_ms = int((time.time() - 2 * 86400) * 1000)
    for i in range(8):  # two full stream nodes of two-day-old entries
        client.xadd(stream, {b"old": b"1"}, id=f"{old_ms + i}-0")
    settings = SamplerSettings(rate=1.0, redis_url=url, redis_stream=stream, retention_s=86400)
    with PayloadSampler(settings, part_rows=5) as sampler:
        for i in range(5):
            sampler.offer(make_sample(crops[0], i, False))
    entries = client.xrange(stream)
    assert [e[1][b"request_id"] for e in entries] == [f"req-{i}".encode() for i in range(5)]


def test_folder_and_parts_are_private(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Under a umask that takes nothing away, the sampler's folder is made 0700 and each part is 0600; an existing
    folder open to others is tightened to 0700."""
    made, existing = tmp_path / "made" / "samples", tmp_path / "existing"
    existing.mkdir()
    existing.chmod(0o777)
    old = os.umask(0)
    try:
        for folder in (made, existing):
            with PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=1) as sampler:
                sampler.offer(make_sample(crops[0], 0, False))
                sampler.offer(make_sample(crops[1], 1, True))
            assert folder.stat().st_mode & 0o777 == 0o700, folder
            parts = list_parts(folder)
            assert len(parts) == 2 and all(p.stat().st_mode & 0o777 == 0o600 for p in parts), parts
    finally:
        os.umask(old)


def test_tenant_column(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """The tenant offered comes back in its column (empty without keys); a part written before the column
    existed reads back with a null tenant."""
    folder = tmp_path / "s"
    folder.mkdir()
    legacy = make_sample(crops[0], 0, False, t=time.time() - 10)
    table = pa.table({k: [getattr(legacy, k) if k != "image" else legacy.crop_png]
                      for k in ("model", "version", "request_id", "image", "top1_label", "top1_score")})
    table = table.append_column("time", pa.array([int(legacy.time * 1e6)], pa.timestamp("us", tz="UTC")))
    pq.write_table(table, folder / part_name(legacy.time, 1, "0123abcd", False))
    with PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=2) as sampler:
        for i, tenant in ((1, "alice"), (2, "key-0a1b2c3d")):
            sampler.offer(Sample(**{**make_sample(crops[i], i, False).__dict__, "tenant": tenant}))
        sampler.offer(make_sample(crops[3], 3, True))
    rows = {r["request_id"]: r for r in read_samples(folder).to_pylist()}
    assert {k: r["tenant"] for k, r in rows.items()} == {"req-0": None, "req-1": "alice", "req-2": "key-0a1b2c3d",
                                                         "req-3": ""}
    assert rows["req-0"]["image"] == legacy.crop_png


DISK_FULL_SCRIPT = """
import json, logging, resource, sys, time
from pathlib import Path
import numpy as np
from vit_serve.runtime.payload_sampler import PayloadSampler, Sample, SamplerSettings, png_bytes, list_parts

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
folder, limit = Path(sys.argv[1]), int(sys.argv[2])
# the crops' PNGs: noise (7 KB each, all different), so that a part of one is under the limit, of eight over it
rng = np.random.default_rng(0)
pngs = [png_bytes(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)) for _ in range(10)]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
dropped = {}

def sample(i):
    return Sample(time=time.time(), model="m", version="1", request_id=f"r{i}", crop_png=pngs[i], top1_label="a",
                  top1_score=0.5, ood_score=None, ood_flag=None)

def count(reason, n):
    dropped[reason] = dropped.get(reason, 0) + n

sampler = PayloadSampler(SamplerSettings(rate=1.0, folder=folder), part_rows=1, dropped=count)
sampler.offer(sample(0))  # one row: a part under the limit
deadline = time.monotonic() + 20
while sampler.stats.written < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
sampler.part_rows = 8  # eight rows: over the limit
for i in range(1, 9):
    sampler.offer(sample(i))
while not sampler.stats.errors and time.monotonic() < deadline:
    time.sleep(0.01)
after = [sampler.wants(None) for _ in range(5)]  # stopped: drawn, counted, not kept
sampler.offer(sample(9))
sampler.close()
print(json.dumps({"written": sampler.stats.written, "disk_full": sampler.stats.disk_full, "dropped": dropped,
                  "after": after, "parts": len(list_parts(folder)),
                  "leftovers": sorted(p.name for p in folder.iterdir() if p.name.startswith("."))}))
"""


def test_a_full_disk_stops_sampling_with_one_warning(tmp_path: Path) -> None:
    """A part that the process's file size limit (RLIMIT_FSIZE, in a subprocess: the real OS path of a full disk,
    EFBIG) cuts short stops sampling: one warning, its samples and every later draw counted as dropped with reason
    disk_full, no temporary file left; the part written before stays; the process goes on."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "s"
    run = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(folder), str(40_000)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["written"] == 1 and got["parts"] == 1 and got["leftovers"] == [], got
    assert got["after"] == [False] * 5
    assert got["dropped"] == {"disk_full": 8 + 5 + 1} and got["disk_full"] == 14, got  # the part, 5 draws, 1 offer
    warnings = [ln for ln in run.stderr.splitlines() if ln.startswith("WARNING") and "full" in ln]
    assert len(warnings) == 1 and "sampling has stopped" in warnings[0], run.stderr


def test_queue_drops_are_reported(tmp_path: Path, crops: list[np.ndarray]) -> None:
    """Drops of a full queue reach the `dropped` callback with reason queue_full."""
    dropped: dict[str, int] = {}
    sampler = PayloadSampler(SamplerSettings(rate=1.0, folder=tmp_path / "s"), part_rows=100, part_seconds=3600,
                             queue_size=2, dropped=lambda reason, n: dropped.update({reason: dropped.get(reason, 0)
                                                                                    + n}))
    with sampler._cond:
        for i in range(5):
            sampler.offer(make_sample(crops[0], i, False))
    sampler.close()
    assert dropped == {"queue_full": 3} and sampler.stats.dropped == 3


def test_redis_password_file_and_ttl(redis_with_password: tuple[str, str, Any], crops: list[np.ndarray],
                                     tmp_path: Path) -> None:
    """A Redis that needs a password: read from redis_password_file, the samples are added; the stream's key
    expires redis_ttl_s after the last batch; without the password the batch is lost and counted; a password in
    both the URL and the file is a one-line error."""
    url, password, client = redis_with_password
    secret = tmp_path / "redis-password"
    secret.write_text(password + "\n")
    stream = f"test:auth:{os.getpid()}"
    settings = SamplerSettings(rate=1.0, redis_url=url, redis_stream=stream, redis_password_file=secret,
                               redis_ttl_s=600)
    with PayloadSampler(settings, part_rows=2) as sampler:
        for i in range(4):
            sampler.offer(make_sample(crops[0], i, False))
    assert sampler.stats.written == 4 and client.xlen(stream) == 4
    assert 590_000 < client.pttl(stream) <= 600_000
    dropped: dict[str, int] = {}
    no_password = SamplerSettings(rate=1.0, redis_url=url, redis_stream=stream)
    with PayloadSampler(no_password, part_rows=2, dropped=lambda r, n: dropped.update({r: n})) as sampler:
        sampler.offer(make_sample(crops[0], 9, False))
        sampler.offer(make_sample(crops[0], 10, False))
    assert sampler.stats.failed == 2 and dropped == {"write_failed": 2} and client.xlen(stream) == 4
    both = SamplerSettings(rate=1.0, redis_url=url.replace("redis://", f"redis://:{password}@"),
                           redis_stream=stream, redis_password_file=secret)
    with pytest.raises(ValueError, match="give it one way") as err:
        PayloadSampler(both)
    assert password not in str(err.value)
    client.delete(stream)


def test_redis_that_never_answers_times_out(crops: list[np.ndarray]) -> None:
    """A Redis address that accepts connections and never answers: with redis_timeout_s the batch is lost and
    counted after the timeout, and close() returns (without a timeout the writer would wait forever)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nothing reads or answers
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        settings = SamplerSettings(rate=1.0, redis_url=url, redis_timeout_s=0.3)
        sampler = PayloadSampler(settings, part_rows=1)
        sampler.offer(make_sample(crops[0], 0, False))
        sampler.close(timeout=20)
        assert not sampler._thread.is_alive()
        assert sampler.stats.failed == 1 and sampler.stats.written == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"redis_ttl_s": 0}, "redis_ttl_s must be a positive number"),
    ({"redis_timeout_s": float("nan")}, "redis_timeout_s must be a positive number"),
])
def test_redis_settings_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="payload sampler") as err:
        SamplerSettings(**kwargs)
    assert message in str(err.value)
