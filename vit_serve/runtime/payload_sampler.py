"""An opt-in payload sampler (issue 24, item 4): a share of the gateway's requests — the model-input crop as PNG,
the top-1 answer, the OOD score and flag, the time — kept as Parquet parts in a folder (or entries of a Redis
stream), so that people can look at what drifted and label it. Off by default (`SamplerSettings.rate == 0`).

How it is used: the gateway asks `wants(flagged)` (a cheap, thread-safe random draw: `rate`, or `flagged_rate`
when the request was OOD-flagged), builds a `Sample` only when the answer is yes, and hands it to `offer`, which
never blocks. A background thread writes; `close()` flushes what is buffered and stops it.

The details:

- Off: with `rate == 0` `wants` is always False, `offer` ignores what it is given, and nothing is created: no
  folder, no file, no thread, no Redis connection. (`flagged_rate` alone does not turn it on.)
- The queue: at most `queue_size` samples wait (default 512). When it is full, the oldest waiting unflagged
  sample is dropped to make room; an unflagged sample offered when only flagged ones wait is itself dropped; only
  when every waiting sample and the new one are flagged does the oldest flagged one go. Drops are counted
  (`stats`).
- Parts: flagged samples (`ood_flag is True`) and the others are written to separate parts, so that eviction can
  take unflagged ones first. A part is written when `part_rows` samples of one kind wait (default 256), when the
  oldest of them has waited `part_seconds` (default 30 s), and on `close()`. One part is one Parquet file of one
  row group with the columns `time` (timestamp[us, UTC]), `model`, `version`, `request_id` (nullable), `image`
  (binary: the PNG), `top1_label`, `top1_score` (float64), `ood_score` (float64, nullable), `ood_flag` (bool,
  nullable) and `tenant` (the verified caller's key name; empty without API keys; null in parts written before
  it existed); the PNG column is stored uncompressed (PNG already is), the rest with zstd.
- Permissions: the folder is made (or tightened to) 0700 and every part is created 0600: the crops are the
  callers' images.
- Names: ``part-<UTC time of the part's newest sample, YYYYmmddTHHMMSS.ffffffZ>-<seq>-<token>-<flagged|normal>
  .parquet``: sortable by time, unique (a per-process sequence number and a random token per sampler, so that
  replicas may share a folder). A part is written to a hidden temporary file in the same folder and moved into
  place with `os.replace`, under a name that does not exist yet: a reader never sees half a part, and no file is
  ever overwritten.
- Retention and the cap, enforced at start, after every write and at least every `part_seconds`: a part whose name
  time (its newest sample) is more than `retention_s` old is deleted; then, while the parts' bytes exceed
  `max_bytes`, the oldest unflagged part is deleted, and only when none is left the oldest flagged one. Only files
  with the sampler's name pattern count and are ever deleted (and its own temporary files left by a crash, once
  an hour old); anything else in the folder is left alone. Several replicas writing to one folder share the cap.
- Redis (`redis_url` instead of `folder`): each sample is one `XADD` to `redis_stream` (pipelined per batch, the
  same batching as the parts), its fields as bytes: time (unix seconds), model, version, image, top1_label,
  top1_score, flagged (b"1"/b"0"), tenant, and request_id, ood_score, ood_flag (b"1"/b"0") only when known. The
  stream is trimmed with ``MAXLEN ~ n``, n being `redis_maxlen` or else `max_bytes` over the mean size of the
  entries sent so far, and by ``XTRIM MINID ~`` to `retention_s`; its key expires `redis_ttl_s` after the last
  batch (so that a Redis whose `maxmemory-policy` is volatile-* can evict it before the explain store's crops,
  and an abandoned stream goes). Redis trims oldest first whatever the flag: there the flagged-first rule holds
  only in the queue (and through `flagged_rate`). The connection has socket timeouts (`redis_timeout_s`); the
  password comes from the URL or from `redis_password_file`.
- Failures never reach the caller: the batch is lost, logged and counted (`stats`, and the `dropped` callback:
  reason `write_failed`). A full disk (ENOSPC, EDQUOT, or EFBIG from RLIMIT_FSIZE) stops sampling for good with
  one warning: the batch and every sample drawn afterwards are counted as dropped with reason `disk_full`;
  serving goes on.

`read_samples(folder)` reads every part of a folder back as one pyarrow Table, sorted by time. pyarrow (folder
mode) and redis (Redis mode) are imported only when the sampler is on.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from PIL import Image

log = logging.getLogger(__name__)

# The name of a part, and of the temporary file it is written to first (hidden: readers skip it).
PART_RE = re.compile(r"^part-(\d{8}T\d{6}\.\d{6}Z)-(\d{6,})-([0-9a-f]{8})-(flagged|normal)\.parquet$")
TEMP_RE = re.compile(r"^\.part-.*\.parquet\.tmp$")
TIME_FORMAT = "%Y%m%dT%H%M%S.%fZ"
# A temporary file of the sampler's this old is a crashed write's leftover, deleted at start.
STALE_TEMP_S = 3600.0
# The latest time a part's name can carry (9999-12-31T23:59:59Z): sample times are clamped to [0, this].
MAX_TIME = 253402300799.0
# The errors of a full disk: no space, over the quota, over the process's file size limit (RLIMIT_FSIZE).
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# The reasons samples are dropped for (`PayloadSampler`'s `dropped` callback).
DROP_REASONS = ("queue_full", "write_failed", "disk_full")


@dataclass(frozen=True)
class SamplerSettings:
    """What the sampler keeps and where (off when `rate` is 0)."""

    rate: float = 0.0  # share of requests kept (0: off)
    folder: Path | None = None  # Parquet parts written here
    max_bytes: int = 256 * 2**20  # the folder's cap; oldest unflagged parts go first
    retention_s: float = 7 * 86400
    redis_url: str | None = None  # instead of a folder: XADD to redis stream `redis_stream`
    redis_stream: str = "vit_serve:samples"
    flagged_rate: float = 1.0  # share of OOD-flagged requests kept (flagged ones first)
    redis_maxlen: int | None = None  # the stream's MAXLEN ~; None: max_bytes / the mean entry size
    redis_ttl_s: float = 86400.0  # the stream's key expires this long after the last batch
    redis_timeout_s: float = 2.0  # socket (connect, read, write) timeout of the Redis connection
    redis_password_file: Path | None = None  # the Redis password, read from this file (not in the URL)

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise ValueError(f"payload sampler: {message}")

        for name in ("rate", "flagged_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                bad(f"{name} must be a number from 0 to 1, not {value!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            bad(f"max_bytes must be a positive integer, not {self.max_bytes!r}")
        if (isinstance(self.retention_s, bool) or not isinstance(self.retention_s, int | float)
                or not math.isfinite(self.retention_s) or self.retention_s <= 0):
            bad(f"retention_s must be a positive number of seconds, not {self.retention_s!r}")
        if self.redis_maxlen is not None and (isinstance(self.redis_maxlen, bool) or not isinstance(
                self.redis_maxlen, int) or self.redis_maxlen <= 0):
            bad(f"redis_maxlen must be a positive integer or None, not {self.redis_maxlen!r}")
        for name in ("redis_ttl_s", "redis_timeout_s"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                    or value <= 0):
                bad(f"{name} must be a positive number of seconds, not {value!r}")
        if not self.redis_stream:
            bad("redis_stream must not be empty")
        for name in ("folder", "redis_password_file"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Path):
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.rate > 0 and (self.folder is None) == (self.redis_url is None):
            bad("with rate > 0 give either a folder (--sample-dir) or a Redis URL, not "
                + ("both" if self.folder is not None else "neither"))

    @property
    def enabled(self) -> bool:
        """Whether anything is sampled at all (rate > 0)."""
        return self.rate > 0


@dataclass(frozen=True)
class Sample:
    """One kept request: the model-input crop as PNG, the top-1 answer, the OOD score and flag, the time."""

    time: float  # unix seconds
    model: str
    version: str
    request_id: str | None
    crop_png: bytes  # the model-input crop as PNG
    top1_label: str
    top1_score: float
    ood_score: float | None
    ood_flag: bool | None
    tenant: str = ""  # the verified caller's key name; empty without API keys

    @property
    def flagged(self) -> bool:
        """OOD-flagged (kept first)."""
        return self.ood_flag is True


@dataclass
class SamplerStats:
    """What the sampler did with what it was offered (counts since start)."""

    offered: int = 0  # accepted into the queue
    dropped: int = 0  # dropped because the queue was full (flagged ones included)
    dropped_flagged: int = 0  # of those, flagged
    written: int = 0  # samples written (rows of parts, or stream entries)
    parts: int = 0  # parts written (folder mode)
    failed: int = 0  # samples lost to a failed write
    errors: int = 0  # failed writes
    deleted: int = 0  # parts deleted (retention or cap)
    disk_full: int = 0  # samples dropped because the disk was full (the lost batch, and every draw after it)


def png_bytes(image: Image.Image | np.ndarray, compress_level: int = 1) -> bytes:
    """`image` (a PIL image, or a uint8 HxW / HxWxC array) as PNG bytes (fast compression: level 1)."""
    import io

    import numpy as np
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.ascontiguousarray(image))
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def part_name(newest: float, seq: int, token: str, flagged: bool) -> str:
    """The file name of a part whose newest sample is from `newest` (unix s)."""
    stamp = datetime.fromtimestamp(_clamp_time(newest), UTC).strftime(TIME_FORMAT)
    return f"part-{stamp}-{seq:06d}-{token}-{'flagged' if flagged else 'normal'}.parquet"


def part_time(name: str) -> float | None:
    """The unix time in a part's name (its newest sample), None when `name` is not a part's."""
    m = PART_RE.match(name)
    if m is None:
        return None
    return datetime.strptime(m.group(1), TIME_FORMAT).replace(tzinfo=UTC).timestamp()


def list_parts(folder: Path) -> list[Path]:
    """The sampler's parts in `folder`, oldest first (by name); none when there is no folder."""
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return [folder / name for name in sorted(names) if PART_RE.match(name)]


def schema() -> pa.Schema:
    """The parts' columns."""
    import pyarrow as pa

    return pa.schema([
        ("time", pa.timestamp("us", tz="UTC")),
        ("model", pa.string()),
        ("version", pa.string()),
        ("request_id", pa.string()),
        ("image", pa.binary()),
        ("top1_label", pa.string()),
        ("top1_score", pa.float64()),
        ("ood_score", pa.float64()),
        ("ood_flag", pa.bool_()),
        ("tenant", pa.string()),
    ])


def read_samples(folder: str | os.PathLike[str]) -> pa.Table:
    """Every sample of the parts in `folder` as one Table (the parts' columns), sorted by time; an empty Table
    when there is none. Parts deleted while it reads (eviction) are skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = schema()
    tables = []
    for path in list_parts(Path(folder)):
        try:
            table = pq.read_table(path)
        except FileNotFoundError:
            continue
        for column in want:  # a column added since the part was written (tenant): null there
            if column.name not in table.column_names:
                table = table.append_column(column, pa.nulls(table.num_rows, column.type))
        tables.append(table.select(want.names).cast(want))
    if not tables:
        return schema().empty_table()
    return pa.concat_tables(tables).sort_by("time")


def _clamp_time(t: float) -> float:
    return min(max(t, 0.0), MAX_TIME) if math.isfinite(t) else time.time()


def _to_table(samples: list[Sample]) -> pa.Table:
    import pyarrow as pa

    return pa.table({
        "time": [round(_clamp_time(s.time) * 1e6) for s in samples],
        "model": [s.model for s in samples],
        "version": [s.version for s in samples],
        "request_id": [s.request_id for s in samples],
        "image": [bytes(s.crop_png) for s in samples],
        "top1_label": [s.top1_label for s in samples],
        "top1_score": [float(s.top1_score) for s in samples],
        "ood_score": [None if s.ood_score is None else float(s.ood_score) for s in samples],
        "ood_flag": [None if s.ood_flag is None else bool(s.ood_flag) for s in samples],
        "tenant": [s.tenant for s in samples],
    }, schema=schema())


def _redis_fields(s: Sample) -> dict[bytes, bytes]:
    fields = {b"time": repr(float(s.time)).encode(), b"model": s.model.encode(), b"version": s.version.encode(),
              b"image": bytes(s.crop_png), b"top1_label": s.top1_label.encode(),
              b"top1_score": repr(float(s.top1_score)).encode(), b"flagged": b"1" if s.flagged else b"0",
              b"tenant": s.tenant.encode()}
    if s.request_id is not None:
        fields[b"request_id"] = s.request_id.encode()
    if s.ood_score is not None:
        fields[b"ood_score"] = repr(float(s.ood_score)).encode()
    if s.ood_flag is not None:
        fields[b"ood_flag"] = b"1" if s.ood_flag else b"0"
    return fields


@dataclass
class _Waiting:
    """The samples of one kind (flagged or not) waiting to be written, with when each was queued (monotonic)."""

    items: collections.deque[tuple[float, Sample]] = field(default_factory=collections.deque)

    def due(self, now: float, rows: int, seconds: float) -> bool:
        return len(self.items) >= rows or (bool(self.items) and now - self.items[0][0] >= seconds)

    def take(self, rows: int) -> list[Sample]:
        return [self.items.popleft()[1] for _ in range(min(rows, len(self.items)))]


class PayloadSampler:
    """Keeps a share of requests (`SamplerSettings`) as Parquet parts or Redis stream entries, written by a
    background thread; see the module's docstring for the rules. `dropped(reason, n)` is called for samples
    dropped (`DROP_REASONS`), from any thread: the gateway counts them in a metric."""

    PART_ROWS = 256  # a part (or a Redis batch) at this many samples of one kind...
    PART_SECONDS = 30.0  # ...or once the oldest of them has waited this long
    QUEUE_SIZE = 512  # samples waiting at most (flagged and unflagged together)

    def __init__(self, settings: SamplerSettings, seed: int | None = None, *, part_rows: int | None = None,
                 part_seconds: float | None = None, queue_size: int | None = None,
                 dropped: Callable[[str, int], None] | None = None) -> None:
        self.settings = settings
        self._dropped = dropped
        self.part_rows = self.PART_ROWS if part_rows is None else part_rows
        self.part_seconds = self.PART_SECONDS if part_seconds is None else part_seconds
        self.queue_size = self.QUEUE_SIZE if queue_size is None else queue_size
        if self.part_rows < 1 or not self.part_seconds > 0 or self.queue_size < 1:
            raise ValueError(f"payload sampler: part_rows ({self.part_rows}) and queue_size ({self.queue_size}) "
                             f"must be at least 1, part_seconds ({self.part_seconds}) positive")
        self.stats = SamplerStats()
        self._rng = random.Random(seed)
        self._draw_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting = {True: _Waiting(), False: _Waiting()}
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._token = secrets.token_hex(4)
        self._seq = 0
        self._redis: Any = None
        self._redis_bytes = 0  # the bytes of the entries sent so far (their mean sizes MAXLEN)
        self._redis_entries = 0
        self._last_enforced = time.monotonic()
        self._disk_full = False  # set once by the writer: sampling has stopped
        if not settings.enabled:
            return
        if settings.folder is not None:
            import pyarrow.parquet  # noqa: F401  (fail at start, not in the thread, when pyarrow is missing)

            _private_folder(settings.folder)
            self._remove_stale_temps()
            self.enforce()
        else:
            import redis

            auth = {}
            if settings.redis_password_file is not None:
                auth["password"] = _read_password(settings.redis_password_file, settings.redis_url or "")
            t = settings.redis_timeout_s
            self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=t, socket_connect_timeout=t,
                                               **auth)
        self._thread = threading.Thread(target=self._run, name="vit-serve-payload-sampler", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        """Whether this sampler keeps anything (its settings' rate > 0, and not closed)."""
        return self._thread is not None and not self._closing

    def wants(self, flagged: bool | None) -> bool:
        """The random draw: True with probability `rate` (`flagged_rate` when `flagged` is True); always False
        when off or closed. Cheap and thread-safe."""
        if not self.enabled:
            return False
        p = self.settings.flagged_rate if flagged is True else self.settings.rate
        if p >= 1:
            yes = True
        elif p <= 0:
            yes = False
        else:
            with self._draw_lock:
                yes = self._rng.random() < p
        if yes and self._disk_full:  # stopped: what would have been kept is counted, nothing is encoded
            self.stats.disk_full += 1
            self._drop("disk_full", 1)
            return False
        return yes

    def offer(self, sample: Sample) -> None:
        """Queue `sample` for writing; never blocks. When the queue is full the oldest unflagged sample waiting
        (or this one, when it is unflagged and only flagged ones wait) is dropped and counted. Ignored when off."""
        if not self.enabled:
            return
        if self._disk_full:
            self.stats.disk_full += 1
            self._drop("disk_full", 1)
            return
        flagged = sample.flagged
        with self._cond:
            if self._closing:
                return
            if len(self._waiting[True].items) + len(self._waiting[False].items) >= self.queue_size:
                self._drop("queue_full", 1)
                if self._waiting[False].items:
                    self._waiting[False].items.popleft()
                    self.stats.dropped += 1
                elif not flagged:
                    self.stats.dropped += 1
                    return
                else:
                    self._waiting[True].items.popleft()
                    self.stats.dropped += 1
                    self.stats.dropped_flagged += 1
            queue = self._waiting[flagged].items
            queue.append((time.monotonic(), sample))
            self.stats.offered += 1
            if len(queue) == 1 or len(queue) >= self.part_rows:
                self._cond.notify()  # a new deadline (the writer may wait without one), or a full part

    def close(self, timeout: float | None = 60.0) -> None:
        """Write what is waiting, stop the thread (waiting at most `timeout` s for it) and close the Redis
        connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> PayloadSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread ------------------------------------------------------------------------------------

    def _due(self) -> list[tuple[bool, list[Sample]]]:
        """The batches due now, taken from the queue; waits until one is due, closing, or (folder mode) time to
        enforce retention again, then returns (maybe nothing)."""
        with self._cond:
            while True:
                now = time.monotonic()
                batches = [(flagged, w.take(self.part_rows)) for flagged, w in self._waiting.items()
                           if (self._closing and w.items) or w.due(now, self.part_rows, self.part_seconds)]
                if batches or self._closing:
                    return batches
                deadlines = [w.items[0][0] + self.part_seconds for w in self._waiting.values() if w.items]
                if self.settings.folder is not None:
                    deadlines.append(self._last_enforced + self.part_seconds)
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                if timeout == 0:
                    return []
                self._cond.wait(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                done = self._closing and not any(w.items for w in self._waiting.values())
            if done:
                return
            for flagged, samples in self._due():
                self._write(flagged, samples)
            if self.settings.folder is not None and time.monotonic() - self._last_enforced >= self.part_seconds:
                self._enforce_logged()

    def _drop(self, reason: str, n: int) -> None:
        if self._dropped is not None and n:
            try:
                self._dropped(reason, n)
            except Exception:  # a counter must not stop the writer
                log.exception("payload sampler: counting dropped samples failed")

    def _write(self, flagged: bool, samples: list[Sample]) -> None:
        if self._disk_full:  # stopped: what was queued before the stop is dropped too
            self.stats.disk_full += len(samples)
            self._drop("disk_full", len(samples))
            return
        try:
            if self.settings.folder is not None:
                self._write_part(flagged, samples)
            else:
                self._send(samples)
            self.stats.written += len(samples)
        except Exception as e:
            self.stats.errors += 1
            self.stats.failed += len(samples)
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                self._disk_full = True
                self.stats.disk_full += len(samples)
                self._drop("disk_full", len(samples))
                log.warning("payload sampler: %s is full (%s); sampling has stopped until the gateway restarts "
                            "(vit_serve_samples_dropped_total{reason=\"disk_full\"} counts what it would have "
                            "kept); serving goes on", self.settings.folder, os.strerror(e.errno or 0))
            else:
                self._drop("write_failed", len(samples))
                log.exception("payload sampler: %d samples lost", len(samples))
        if self.settings.folder is not None:
            self._enforce_logged()

    def _write_part(self, flagged: bool, samples: list[Sample]) -> Path:
        import pyarrow.parquet as pq

        folder = self.settings.folder
        assert folder is not None
        newest = max(s.time for s in samples)
        while True:
            self._seq += 1
            path = folder / part_name(newest, self._seq, self._token, flagged)
            if not path.exists():
                break
        temp = folder / f".{path.name}.tmp"
        try:
            compression = {name: ("none" if name == "image" else "zstd") for name in schema().names}
            # created 0600 (O_EXCL: never through a planted link), whatever the umask allows
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as out:
                pq.write_table(_to_table(samples), out, compression=compression)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        self.stats.parts += 1
        return path

    def _send(self, samples: list[Sample]) -> None:
        entries = [_redis_fields(s) for s in samples]
        self._redis_bytes += sum(len(k) + len(v) for e in entries for k, v in e.items())
        self._redis_entries += len(entries)
        maxlen = self.settings.redis_maxlen or max(1, self.settings.max_bytes * self._redis_entries
                                                   // max(1, self._redis_bytes))
        stream = self.settings.redis_stream
        pipe = self._redis.pipeline(transaction=False)
        for entry in entries:
            pipe.xadd(stream, entry, maxlen=maxlen, approximate=True)
        min_ms = int((time.time() - self.settings.retention_s) * 1000)
        if min_ms > 0:
            pipe.xtrim(stream, minid=f"{min_ms}-0", approximate=True)
        pipe.pexpire(stream, max(1, round(self.settings.redis_ttl_s * 1000)))
        pipe.execute()

    # -- retention and the cap --------------------------------------------------------------------------------

    def _enforce_logged(self) -> None:
        try:
            self.enforce()
        except Exception:
            log.exception("payload sampler: enforcing retention and the cap failed")

    def enforce(self, now: float | None = None) -> list[Path]:
        """Delete the folder's parts older than `retention_s` (by their name's time), then, while its parts
        exceed `max_bytes`, the oldest unflagged part (the oldest flagged one when no unflagged part is left).
        Returns the parts deleted; nothing in Redis mode or when off."""
        self._last_enforced = time.monotonic()
        folder = self.settings.folder
        if folder is None or not self.settings.enabled:
            return []
        now = time.time() if now is None else now
        deleted: list[Path] = []
        sizes: dict[Path, int] = {}
        for path in list_parts(folder):
            t = part_time(path.name)
            if t is not None and now - t > self.settings.retention_s:
                if self._delete(path):
                    deleted.append(path)
                continue
            try:
                sizes[path] = path.stat().st_size
            except FileNotFoundError:
                continue
        total = sum(sizes.values())
        for kind in ("normal", "flagged"):
            for path in [p for p in sizes if p.name.endswith(f"-{kind}.parquet")]:
                if total <= self.settings.max_bytes:
                    break
                total -= sizes[path]
                if self._delete(path):
                    deleted.append(path)
        return deleted

    def _delete(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False  # another replica's sampler took it first
        self.stats.deleted += 1
        return True

    def _remove_stale_temps(self) -> None:
        folder = self.settings.folder
        assert folder is not None
        for entry in os.scandir(folder):
            if TEMP_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    if time.time() - entry.stat().st_mtime > STALE_TEMP_S:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue


def _private_folder(folder: Path) -> None:
    """Make `folder` 0700, or tighten an existing one that others may read to 0700."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = folder.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            os.chmod(folder, 0o700)
        except PermissionError:
            log.warning("payload sampler: %s is open to others (mode %o) and not ours to change", folder, mode)
        else:
            log.info("payload sampler: %s was mode %o, made 0700 (the samples are callers' images)", folder, mode)


def _read_password(path: Path, url: str) -> str:
    """The Redis password of `path` (a Secret mount: one trailing newline dropped); ValueError (one line)."""
    from urllib.parse import urlsplit

    if urlsplit(url).password:
        raise ValueError("payload sampler: a Redis password file is given and the sample Redis URL has a password "
                         "too: give it one way")
    from vit_serve.runtime.password_file import read_password_file

    return read_password_file(path, "payload sampler: the Redis password file")
