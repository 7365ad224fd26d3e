"""Where `vit-serve predict` writes: JSON Lines, CSV or Parquet rows, resumable, with the files beside them.

OUT is `preds.jsonl`, `preds.csv` or `preds.parquet` (a folder of part files). Beside it:

* `OUT.manifest.json`: the model (name, version, file, sha256) and the settings the rows were made with. A rerun
  with another model or other settings is refused (`ManifestMismatchError`) unless `force`, which starts over.
* `OUT.errors.jsonl`: `{"path", "error"}` for each file this run could not read (rewritten every run: unreadable
  files are tried again).
* `OUT.rollout.npy`: with `--explain`, float32 [N, gh, gw]; a row's `rollout_index` names its map.

Text. Every file is UTF-8, and a JSON Lines file ends its lines at "\\n" only (U+2028, U+2029, U+0085 are text inside
a row, as JSON says). A file name that is not UTF-8 (Linux allows any bytes; Python lists the byte 0xE9 as the
surrogate U+DCE9, `surrogateescape`) is kept in JSON as its escape `\\udce9`, which `json.loads` reads back to the
name that opens the file; CSV and Parquet text cannot hold it, so such a file is listed in OUT.errors.jsonl with
why (`key_problem`), before it is decoded, and the run goes on.

Kill safety. JSONL and CSV rows are appended and flushed once per batch; a torn last line (a kill mid-write) is cut
off when the file is opened again. Parquet is a folder of parts, each written to a hidden temporary file and
renamed into place (`os.replace`), so a part is either whole or absent: pyarrow and pandas read the folder as one
table and ignore hidden files. A Parquet file cannot be appended to, and rewriting one file per batch would cost
O(N^2), hence parts. The rollout maps of a batch are appended (and the .npy header's row count updated) before its
rows are written, so every written row's map is there; maps of rows lost to a kill stay unreferenced.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.manifest import EMBEDDING_FINGERPRINT, OOD_SCORE

FORMATS = {".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}
MANIFEST_VERSION = 1
OOD_COLUMNS = (OOD_SCORE, "ood_flag")  # the "ood" column group: a model with a reference (vit_serve.monitor)
Row = dict[str, Any]


class ManifestMismatchError(ValueError):
    """OUT exists and was written with another model or other settings (or not by `vit-serve predict`)."""


def output_format(out: Path) -> str:
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ValueError(f"--out {out}: expected a .jsonl, .csv or .parquet name")
    return fmt


def sidecar(out: Path, what: str) -> Path:
    """`preds.jsonl` -> `preds.jsonl.<what>` (manifest.json, errors.jsonl, rollout.npy)."""
    return out.with_name(f"{out.name}.{what}")


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


_SURROGATE = re.compile("[\ud800-\udfff]")


def json_line(obj: Any) -> str:
    """`obj` as one JSON line: non-ASCII text as is, a lone surrogate (a file name's undecodable byte) as its JSON
    escape, so that the line is always UTF-8 and reads back to the same strings."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n"


def printable(path: str) -> str:
    """A path for a message: an undecodable byte of its name as `\\xe9` (a terminal cannot print a surrogate)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _not_utf8(path: str, fmt: str) -> str | None:
    if not _SURROGATE.search(path):
        return None
    return (f"its name is not UTF-8 ({printable(path)}), and {fmt} text is: rename it, or write JSON Lines (which "
            f"keeps such a name escaped)")


# ---- the manifest --------------------------------------------------------------------------------------------

def check_manifest(out: Path, key: dict[str, Any], force: bool) -> None:
    """Before anything is written: refuse OUT written with another model or settings (ManifestMismatchError),
    or remove OUT and its sidecars when `force`."""
    files = [out, *(sidecar(out, w) for w in ("manifest.json", "errors.jsonl", "rollout.npy"))]
    if force:
        for f in files:
            if f.is_dir():
                shutil.rmtree(f)
            elif f.exists():
                f.unlink()
        return
    man = sidecar(out, "manifest.json")
    if not man.exists():
        if out.exists() or sidecar(out, "rollout.npy").exists():
            raise ManifestMismatchError(f"{out} exists but has no {man.name} (not written by vit-serve predict); "
                                        f"pass --force to replace it")
        return
    try:
        old = json.loads(man.read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestMismatchError(f"{man} is unreadable ({e}); pass --force to start over") from None
    diff = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
    if diff:
        what = "; ".join(f"{k}: {old.get(k)!r} there, {key.get(k)!r} now" for k in diff)
        raise ManifestMismatchError(f"{out} was written with other settings ({what}); pass --force to replace it, "
                                    f"or write to another --out")


def write_manifest(out: Path, key: dict[str, Any], about: dict[str, Any]) -> None:
    """OUT.manifest.json, atomically: `key` (what must match to resume) and `about` (informative)."""
    man = sidecar(out, "manifest.json")
    tmp = man.with_name(f".{man.name}.tmp")
    tmp.write_text(json.dumps({"vit_serve_predict": MANIFEST_VERSION, "key": key, **about}, indent=2) + "\n")
    os.replace(tmp, man)


# ---- rows ------------------------------------------------------------------------------------------------------

def _cut_torn_tail(path: Path) -> bytes:
    """The file's complete lines; a torn last line (no newline: killed mid-write) is cut off the file."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end]


class _LineWriter:
    """Appends whole lines, flushed per batch (JSONL, CSV)."""

    def __init__(self, path: Path, top_k: int, columns: tuple[str, ...]) -> None:
        self.path, self.top_k, self.columns = path, top_k, columns
        self.done: set[str] = set()
        if path.exists():
            self.done = self._read(_cut_torn_tail(path))
            self.f = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - held open for the run, closed by close()
        else:
            self.f = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 - held open for the run, closed by close()
            self._start()
        self.rows = len(self.done)

    def _start(self) -> None:
        pass

    def _read(self, data: bytes) -> set[str]:
        raise NotImplementedError

    def _lines(self, rows: list[Row]) -> str:
        raise NotImplementedError

    def key_problem(self, path: str) -> str | None:
        """Why a row keyed `path` cannot be written to this file (None: it can)."""
        return None

    def write(self, rows: list[Row]) -> None:
        if rows:
            self.f.write(self._lines(rows))
            self.f.flush()
            self.rows += len(rows)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class JsonlWriter(_LineWriter):
    def _read(self, data: bytes) -> set[str]:
        done = set()
        for n, line in enumerate(data.split(b"\n")[:-1], 1):  # lines end at "\n" only: not str.splitlines()
            try:
                done.add(json.loads(line)["path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{self.path}: line {n} is not a prediction row; pass --force to replace the "
                                 f"file") from None
        return done

    def _lines(self, rows: list[Row]) -> str:
        # strict JSON: NaN -> null, as /classify
        return "".join(json_line({**r, "scores": [_finite(s) for s in r["scores"]]}) for r in rows)


class CsvWriter(_LineWriter):
    """One column per rank (label_1, index_1, score_1, ...); the embedding as a JSON list in one column."""

    def header(self) -> list[str]:
        ranks = [f"{c}_{i}" for i in range(1, self.top_k + 1) for c in ("label", "index", "score")]
        head = [c for c in ("target", "target_index") if c in self.columns]
        tail = [c for c in ("embedding", EMBEDDING_FINGERPRINT, "rollout_index") if c in self.columns] + (
            list(OOD_COLUMNS) if "ood" in self.columns else [])
        return ["path", *head, *ranks, *tail]

    def _start(self) -> None:
        self.f.write(self._csv([self.header()]))
        self.f.flush()

    def key_problem(self, path: str) -> str | None:
        return _not_utf8(path, "CSV")

    @staticmethod
    def _csv(records: list[list[Any]]) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(records)
        return buf.getvalue()

    def _read(self, data: bytes) -> set[str]:
        records = list(csv.reader(io.StringIO(data.decode("utf-8"))))
        if not records or records[0] != self.header():
            raise ValueError(f"{self.path}: its header is not this run's columns; pass --force to replace it")
        return {r[0] for r in records[1:] if r}

    def _lines(self, rows: list[Row]) -> str:
        records = []
        for r in rows:
            ranks = [v for lab, i, s in zip(r["labels"], r["indices"], r["scores"], strict=True)
                     for v in (lab, i, "" if _finite(s) is None else repr(s))]
            head = [r[c] for c in ("target", "target_index") if c in self.columns]
            tail = [json.dumps(r["embedding"]) if c == "embedding" else r[c]
                    for c in ("embedding", EMBEDDING_FINGERPRINT, "rollout_index") if c in self.columns] + (
                [r[c] for c in OOD_COLUMNS] if "ood" in self.columns else [])
            records.append([r["path"], *head, *ranks, *tail])
        return self._csv(records)


def parquet_schema(columns: tuple[str, ...]):
    """The Parquet columns (pyarrow schema) of a run with these optional `columns`."""
    import pyarrow as pa

    fields = [pa.field("path", pa.string())]
    if "target" in columns:
        fields += [pa.field("target", pa.string()), pa.field("target_index", pa.int64())]
    fields += [pa.field("labels", pa.list_(pa.string())), pa.field("indices", pa.list_(pa.int64())),
               pa.field("scores", pa.list_(pa.float64()))]
    if "embedding" in columns:
        fields.append(pa.field("embedding", pa.list_(pa.float32())))
    if EMBEDDING_FINGERPRINT in columns:
        fields.append(pa.field(EMBEDDING_FINGERPRINT, pa.string()))
    if "rollout_index" in columns:
        fields.append(pa.field("rollout_index", pa.int64()))
    if "ood" in columns:
        fields += [pa.field("ood_score", pa.float64()), pa.field("ood_flag", pa.bool_())]
    return pa.schema(fields)


class ParquetWriter:
    """A folder of parts `part-NNNNNN.parquet`, each renamed into place whole; rows are buffered until
    `part_rows` of them, or `part_s` seconds since the last part, then written as one part."""

    def __init__(self, path: Path, columns: tuple[str, ...], part_rows: int = 4096, part_s: float = 30.0) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"Parquet output needs pyarrow (pip install 'vit-serve[predict]'): {e}") from e
        self.pq, self.path, self.part_rows, self.part_s = pq, path, part_rows, part_s
        self.schema = parquet_schema(columns)
        if path.exists() and not path.is_dir():
            raise ValueError(f"--out {path}: a Parquet output is a folder of parts, and this is a file")
        path.mkdir(parents=True, exist_ok=True)
        for tmp in path.glob(".part-*.tmp"):  # a part being written when the last run was killed
            tmp.unlink()
        parts = sorted(path.glob("part-*.parquet"))
        self.done = set()
        for p in parts:
            self.done.update(pq.read_table(p, columns=["path"]).column("path").to_pylist())
        self.next = max((int(p.stem.split("-")[1]) for p in parts), default=-1) + 1
        self.rows = len(self.done)
        self.buffer: list[Row] = []
        self.last = time.monotonic()

    def key_problem(self, path: str) -> str | None:
        """Why a row keyed `path` cannot be written (Parquet strings are UTF-8); None: it can."""
        return _not_utf8(path, "Parquet")

    def write(self, rows: list[Row]) -> None:
        self.buffer += rows
        if len(self.buffer) >= self.part_rows or time.monotonic() - self.last >= self.part_s:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        import pyarrow as pa

        cols = {f.name: [r[f.name] for r in self.buffer] for f in self.schema}
        cols["scores"] = [[_finite(s) for s in r] for r in cols["scores"]]
        table = pa.Table.from_pydict(cols, schema=self.schema)
        name = f"part-{self.next:06d}.parquet"
        tmp = self.path / f".{name}.tmp"
        self.pq.write_table(table, tmp)
        os.replace(tmp, self.path / name)
        self.next += 1
        self.rows += len(self.buffer)
        self.buffer, self.last = [], time.monotonic()

    def close(self) -> None:
        self.flush()


def open_writer(out: Path, top_k: int, columns: tuple[str, ...], part_rows: int = 4096
                ) -> JsonlWriter | CsvWriter | ParquetWriter:
    """The writer of OUT's format, its torn tail repaired and `.done` the paths already written."""
    fmt = output_format(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        return ParquetWriter(out, columns, part_rows)
    return (JsonlWriter if fmt == "jsonl" else CsvWriter)(out, top_k, columns)


# ---- rollout maps and errors -----------------------------------------------------------------------------------

class RolloutFile:
    """OUT.rollout.npy, float32 [N, gh, gw], appended a batch at a time. numpy pads the header so that N can grow
    to 21 digits without moving the data, so the header is rewritten in place after each append; on opening, N
    is recounted from the file's size and a torn last map is cut off."""

    def __init__(self, path: Path, grid: tuple[int, int]) -> None:
        self.path, self.grid = path, tuple(grid)
        self.map_bytes = 4 * grid[0] * grid[1]
        if path.exists():
            with open(path, "rb") as f:
                read = {(1, 0): np.lib.format.read_array_header_1_0,
                        (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(f))
                if read is None:
                    raise ValueError(f"{path} is not an .npy file this version of numpy writes; pass --force")
                shape, fortran, dtype = read(f)
                self.offset = f.tell()
            if tuple(shape[1:]) != self.grid or dtype != np.dtype("<f4") or fortran:
                raise ValueError(f"{path} holds maps of shape {tuple(shape[1:])}, not {self.grid}; pass --force")
            self.n = (path.stat().st_size - self.offset) // self.map_bytes
            self.f = open(path, "r+b")  # noqa: SIM115 - held open for the run, closed by close()
            self.f.truncate(self.offset + self.n * self.map_bytes)
        else:
            self.f = open(path, "w+b")  # noqa: SIM115 - held open for the run, closed by close()
            self.n = 0
            self._header()
            self.offset = self.f.tell()

    def _header(self) -> None:
        self.f.seek(0)
        np.lib.format.write_array_header_1_0(self.f, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (self.n, *self.grid)})

    def append(self, maps: np.ndarray) -> list[int]:
        """maps [B, gh, gw] -> their indices in the file (durable against a kill of this process on return)."""
        first = self.n
        self.f.seek(self.offset + self.n * self.map_bytes)
        self.f.write(np.ascontiguousarray(maps, dtype="<f4").tobytes())
        self.n += len(maps)
        self._header()
        self.f.flush()
        return list(range(first, self.n))

    def close(self) -> None:
        self.f.close()


class ErrorLog:
    """OUT.errors.jsonl: the files this run could not read, `{"path", "error"}` a line, flushed as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[tuple[str, str]] = []
        self.f = None
        path.unlink(missing_ok=True)  # last run's list: its files are tried again

    def add(self, path: str, error: str) -> None:
        if self.f is None:
            self.f = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - held open for the run, closed by close()
        self.errors.append((path, error))
        self.f.write(json_line({"path": path, "error": error}))
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
