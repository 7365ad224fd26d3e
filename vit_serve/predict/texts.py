"""`vit-serve predict --task embed-text`: a text file of queries, one a line, through the model's text tower.

The tower is the one the gateway runs for `?labels=` (`vit_serve.runtime.text_tower.TextTower`): `NAME_text.onnx`
beside an export, or the text tower a converted CLIP / SigLIP checkpoint holds. Each row is `{"text", "embedding",
"embedding_fingerprint"}` (L2-normalised with `--normalize`, as the image rows of `--task embed`), and the
fingerprint is that of the model's image embeddings at the same normalisation: a query row and an image row are
comparable exactly when their fingerprints are equal (`vit_serve.fingerprint`). OUT is `.parquet` (a folder with one
part, as the image rows' format), `.jsonl` or `.csv` (the embedding as a JSON list); it is rewritten whole each run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vit_serve.manifest import EMBEDDING_FINGERPRINT
from vit_serve.predict.batch import load_backend
from vit_serve.predict.options import PredictOptions
from vit_serve.predict.writers import Row, check_manifest, json_line, output_format, write_manifest

if TYPE_CHECKING:
    from vit_serve.runtime.discovery import VersionSource
    from vit_serve.runtime.text_tower import TextTower


def read_queries(src: str) -> list[str]:
    """A UTF-8 text file -> its non-empty lines (ends of lines at "\\n" or "\\r\\n", surrounding blanks stripped).
    ValueError when it is not UTF-8 text or has no query."""
    try:
        lines = Path(src).read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ValueError(f"{src}: not a UTF-8 text file of queries (one a line)") from None
    queries = [q for q in (line.strip() for line in lines) if q]
    if not queries:
        raise ValueError(f"{src}: no queries (one a line)")
    return queries


def text_tower(source: VersionSource) -> TextTower:
    """The text tower of the model `source` names: its export's NAME_text.onnx, or its checkpoint's own."""
    from vit_serve.runtime.text_tower import TextTower, holds_text_tower, text_tower_of

    path = Path(source.path)
    if source.backend == "torch":
        if not holds_text_tower(path):
            raise ValueError(f"--task embed-text: {path.name} holds no text tower (convert a CLIP / SigLIP "
                             f"checkpoint with vit-serve convert, which keeps it)")
        return TextTower.from_checkpoint(path)
    onnx = text_tower_of(path)
    if onnx is None:
        raise ValueError(f"--task embed-text: {path.name} has no text tower beside it (export it with vit-export "
                         f"--text-tower)")
    return TextTower(onnx)


def write_rows(out: Path, rows: list[Row]) -> None:
    """The rows as OUT's format says, replacing what was there (a Parquet folder's one part renamed in whole)."""
    import os

    fmt = output_format(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([pa.field("text", pa.string()), pa.field("embedding", pa.list_(pa.float32())),
                            pa.field(EMBEDDING_FINGERPRINT, pa.string())])
        out.mkdir(exist_ok=True)
        tmp = out / ".part-000000.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
        os.replace(tmp, out / "part-000000.parquet")
        return
    if fmt == "jsonl":
        text = "".join(json_line(r) for r in rows)
    else:
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerows([["text", "embedding", EMBEDDING_FINGERPRINT],
                     *([r["text"], json.dumps(r["embedding"]), r[EMBEDDING_FINGERPRINT]] for r in rows)])
        text = buf.getvalue()
    out.write_text(text, encoding="utf-8")


def predict_texts(source: VersionSource, opts: PredictOptions, digest: str) -> tuple[int, float]:
    """Embed SRC's queries `opts.batch_size` at a time and write them to OUT (see the module docstring); digest:
    the model's (`job.model_digest`), what OUT's manifest keys on. Returns (rows written, seconds)."""
    from vit_serve.embedding import l2_normalize

    out = Path(opts.out)
    queries = read_queries(opts.src)
    key = {"task": opts.task, "model": source.name, "version": source.version, "model_sha256": digest,
           "normalize": opts.normalize}
    check_manifest(out, key, opts.force)
    backend = load_backend(source, opts)  # the image model: the space the queries are compared in
    fingerprint = backend.info.embedding_fingerprint(opts.normalize)
    backend.close()
    tower = text_tower(source)
    t0 = time.perf_counter()
    try:
        parts = [tower.embed_texts(queries[i:i + opts.batch_size]) for i in range(0, len(queries), opts.batch_size)]
    finally:
        tower.close()
    emb = np.concatenate(parts)
    emb = l2_normalize(emb) if opts.normalize else emb
    rows = [{"text": q, "embedding": e.tolist(), EMBEDDING_FINGERPRINT: fingerprint}
            for q, e in zip(queries, emb, strict=True)]
    write_rows(out, rows)
    write_manifest(out, key, {"model_path": str(source.path), "backend": backend.info.backend,
                              EMBEDDING_FINGERPRINT: fingerprint})
    return len(rows), time.perf_counter() - t0
