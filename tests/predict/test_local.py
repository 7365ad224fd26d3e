"""The local engine (`vit_serve.predict.local.run_local`) on a real tiny model: the scheduler's batches are
`batch_size` consecutive readable files whatever the decode speed (the rows' scores do not depend on it), the rows
come in SRC's order, and a model that fails fails the run with its own error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_serve.predict import Item, PredictOptions, Sink, compute, decode_file, load_backend, make_rows
from vit_serve.predict.job import resolve_model
from vit_serve.predict.local import run_local
from vit_serve.predict.writers import ErrorLog
from vit_serve.runtime.task import Task

LABELS = ["a", "b", "c"]


class Rows:
    """A writer that keeps the rows (what `Sink` writes to)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, rows: list[dict]) -> None:
        self.rows += rows


class Bar:
    def update(self, n: int) -> None:
        pass

    def write(self, line: str) -> None:
        pass


@pytest.fixture(scope="module")
def files(tmp_path_factory, save_tiny) -> tuple[Path, list[str]]:
    """A tiny checkpoint and 11 images, the fourth not an image."""
    root = tmp_path_factory.mktemp("local")
    ckpt = save_tiny(root / "tiny.safetensors", (32, 32), 5, LABELS)
    rng = np.random.default_rng(1)
    paths = []
    for i in range(11):
        path = root / f"{i:02d}.png"
        if i == 3:
            path.write_bytes(b"not an image")
        else:
            Image.fromarray(rng.integers(0, 255, (40, 50 + i, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return ckpt, paths


def _run(ckpt: Path, paths: list[str], tmp_path: Path, workers: int, **options):
    opts = PredictOptions(model=str(ckpt), src=str(tmp_path), out=str(tmp_path / "o.jsonl"), quiet=True, **options)
    backend = load_backend(resolve_model(str(ckpt)), opts)
    batches: list[tuple[str, int]] = []
    run = backend.run

    def recorded(task: Task, x: np.ndarray):
        batches.append((task.kind, x.shape[0]))
        return run(task, x)

    backend.run = recorded  # the real model, its batches recorded
    rows, errors = Rows(), ErrorLog(tmp_path / "errors.jsonl")
    sink = Sink(rows, None, errors, Bar(), backend.info, opts)
    run_local(backend, [Item(p) for p in paths], sink, opts, workers)
    errors.close()
    return backend, rows.rows, batches, errors.errors


@pytest.mark.parametrize("workers", [1, 3])
def test_batches_are_consecutive_readable_files_and_rows_keep_src_order(files, tmp_path, workers):
    ckpt, paths = files
    backend, rows, batches, errors = _run(ckpt, paths, tmp_path, workers, batch_size=4, embeddings=True)
    assert batches == [("embed", 4), ("embed", 4), ("embed", 2)]
    good = [p for i, p in enumerate(paths) if i != 3]
    assert [r["path"] for r in rows] == good
    assert [p for p, _ in errors] == [paths[3]]
    opts = PredictOptions(model=str(ckpt), src=str(tmp_path), out=str(tmp_path / "o.jsonl"), batch_size=4,
                          embeddings=True)
    want = []
    for start in range(0, len(good), 4):  # the same batches run in this thread, as the engine did before
        chunk = good[start:start + 4]
        x = np.stack([decode_file(p, backend.info.preprocess, opts.max_pixels)[0] for p in chunk])
        want += make_rows([Item(p) for p in chunk], *_rows_args(backend, x, opts))
    assert rows == want


def _rows_args(backend, x, opts):
    logits, emb, _, ood = compute(backend, x, opts.embeddings, opts.explain)
    return logits, backend.info, opts, emb, None, ood


def test_explain_runs_as_its_own_task_beside_classify(files, tmp_path):
    ckpt, paths = files
    _, rows, batches, _ = _run(ckpt, paths, tmp_path, 2, batch_size=5, explain=True)
    assert sorted(batches) == sorted([("classify", 5), ("explain", 5)] * 2)
    assert len(rows) == 10


def test_a_failing_model_fails_the_run_with_its_error(files, tmp_path):
    ckpt, paths = files
    opts = PredictOptions(model=str(ckpt), src=str(tmp_path), out=str(tmp_path / "o.jsonl"), quiet=True,
                          batch_size=4)
    backend = load_backend(resolve_model(str(ckpt)), opts)

    def broken(task: Task, x: np.ndarray):
        raise RuntimeError("the model broke")

    backend.run = broken
    errors = ErrorLog(tmp_path / "errors.jsonl")
    with pytest.raises(RuntimeError, match="the model broke"):
        run_local(backend, [Item(p) for p in paths], Sink(Rows(), None, errors, Bar(), backend.info, opts), opts, 2)
    errors.close()
