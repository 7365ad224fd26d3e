"""`vit-serve predict` (the local engine): every SRC kind, every output format read back with the reference readers
(json, the csv module, pandas + pyarrow), resume after a real SIGKILL, corrupt files skipped, scores equal to the real
gateway's `/classify`, embeddings equal to the library's and timm's `forward_head(pre_logits=True)`, rollout maps
equal to `vit_serve.explain.rollout`."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vit_serve
from vit_serve.cli import main
from vit_serve.fingerprint import weights_digest
from vit_serve.manifest import embedding_space_of
from vit_serve.predict import PredictOptions, list_images, predict
from vit_serve.predict.writers import sidecar
from vit_serve.preprocess import PreprocessConfig, preprocess

LABELS = ["tabby", "espresso", "astronaut", "teapot", "lighthouse", "sunflower", "locomotive", "seal", "crane", "fox"]
RES = (32, 48)  # non-square: a transposed rollout grid shows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny) -> Path:
    """A 2-block Ti/16 at 32x48 with random non-trivial weights and an ImageNet-style contract."""
    return save_tiny(tmp_path_factory.mktemp("ckpt") / "tiny.safetensors", RES, 3, LABELS)


@pytest.fixture(scope="module")
def onnx(ckpt, tmp_path_factory) -> Path:
    import vit_export

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = vit_export.export(ckpt, vit_export.ExportOptions(out=tmp_path_factory.mktemp("export"), name="tiny"))
    finally:
        torch.set_num_threads(n)
    assert result.ok
    return result.onnx


def _save(arr: np.ndarray, path: Path, size: tuple[int, int] = (120, 90)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).resize(size, Image.Resampling.BICUBIC).save(path, quality=90)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """An ImageFolder of scikit-image's photos (a/ and b/, one in a sub-folder) and one truncated JPEG."""
    data = pytest.importorskip("skimage.data")
    root = tmp_path_factory.mktemp("photos")
    _save(data.astronaut(), root / "a" / "astronaut.png")
    _save(data.coffee(), root / "a" / "sub" / "coffee.jpg")
    _save(data.chelsea(), root / "b" / "chelsea.jpg", (90, 120))
    _save(data.rocket(), root / "b" / "rocket.jpg")
    good = (root / "b" / "chelsea.jpg").read_bytes()
    (root / "b" / "broken.jpg").write_bytes(good[: len(good) // 3])  # truncated mid-scan
    (root / "b" / "notes.txt").write_text("not an image")
    return root


GOOD = ("a/astronaut.png", "a/sub/coffee.jpg", "b/chelsea.jpg", "b/rocket.jpg")


def run(*args: str) -> int:
    return main(["predict", *map(str, args), "--quiet"])


def read_rows(out: Path) -> list[dict]:
    """OUT read back with the reference readers, as {path, labels, indices, scores, [...]} dicts."""
    if out.suffix == ".jsonl":  # JSON Lines end at "\n" only (U+2028 and the like are text inside a row)
        return [json.loads(line) for line in out.read_bytes().split(b"\n") if line]
    if out.suffix == ".csv":
        rows = []
        with open(out, newline="") as f:
            for r in csv.DictReader(f):
                k = sum(1 for c in r if c.startswith("label_"))
                row = {"path": r["path"], "labels": [r[f"label_{i}"] for i in range(1, k + 1)],
                       "indices": [int(r[f"index_{i}"]) for i in range(1, k + 1)],
                       "scores": [float(r[f"score_{i}"]) for i in range(1, k + 1)]}
                if "embedding" in r:
                    row["embedding"] = json.loads(r["embedding"])
                rows.append(row)
        return rows
    import pandas as pd
    import pyarrow.parquet as pq

    table = pq.read_table(out)  # the folder of parts as one table
    frame = pd.read_parquet(out)
    assert frame["path"].tolist() == table.column("path").to_pylist()
    return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()}
            for r in frame.to_dict(orient="records")]


def by_path(rows: list[dict]) -> dict[str, dict]:
    out = {r["path"]: r for r in rows}
    assert len(out) == len(rows), "duplicate rows"
    return out


def test_every_source_kind_lists_the_same_images(photos, tmp_path, monkeypatch):
    """Reference: the files written (os.walk order aside), for a folder, a glob, a list file, one image and an
    ImageFolder (whose targets are torchvision's sorted class folders)."""
    want = {str(photos / g) for g in (*GOOD, "b/broken.jpg")}
    assert {i.path for i in list_images(str(photos))} == want
    assert {i.path for i in list_images(str(photos / "**" / "*.jpg"))} == {p for p in want if p.endswith(".jpg")}
    listing = tmp_path / "list.txt"
    rel = os.path.relpath(photos / "a" / "astronaut.png", tmp_path)
    listing.write_text(f"# comment\n{rel}\n\n{photos / 'b' / 'rocket.jpg'}\n{rel}\n")
    assert [i.path for i in list_images(str(listing))] == [str(tmp_path / rel), str(photos / "b" / "rocket.jpg")]
    assert [i.path for i in list_images(str(photos / "b" / "rocket.jpg"))] == [str(photos / "b" / "rocket.jpg")]
    items = list_images(str(photos), image_folder=True)
    assert {(Path(i.path).relative_to(photos).parts[0], i.target, i.target_index) for i in items} == {
        ("a", "a", 0), ("b", "b", 1)}
    with pytest.raises(ValueError, match="no images found"):
        list_images(str(tmp_path / "*.webp"))
    with pytest.raises(FileNotFoundError):
        list_images(str(tmp_path / "missing"))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_formats_read_back_and_corrupt_files_are_skipped(fmt, onnx, photos, tmp_path, capsys):
    out = tmp_path / f"preds.{fmt}"
    assert run(onnx, photos, "--out", out, "--batch-size", "3", "--top-k", "3") == 0
    said = capsys.readouterr().out
    assert "4 rows written" in said and "1 unreadable" in said
    rows = by_path(read_rows(out))
    assert set(rows) == {str(photos / g) for g in GOOD}
    for r in rows.values():
        assert len(r["labels"]) == 3 and r["labels"] == [LABELS[i] for i in r["indices"]]
        assert r["scores"] == sorted(r["scores"], reverse=True) and 0 < sum(r["scores"]) <= 1 + 1e-9
    errors = [json.loads(line) for line in (tmp_path / f"preds.{fmt}.errors.jsonl").read_text().splitlines()]
    assert [e["path"] for e in errors] == [str(photos / "b" / "broken.jpg")]
    assert "corrupt or truncated" in errors[0]["error"]
    manifest = json.loads((tmp_path / f"preds.{fmt}.manifest.json").read_text())
    assert manifest["key"]["model"] == "tiny" and manifest["labels"] == LABELS


def test_token_merging_on_a_checkpoint(ckpt, photos, tmp_path):
    """`--tome 1`: the rows are the library's model with `set_token_merging(1)` on the exactly decoded photos; a
    rerun into the same OUT with another r is refused (the rows would mix)."""
    out = tmp_path / "p.jsonl"
    assert run(ckpt, photos, "--out", out, "--tome", "1", "--decode", "exact", "--top-k", "10") == 0
    rows = by_path(read_rows(out))
    model = vit_serve.load(ckpt).eval()
    model.set_token_merging(1)
    for g in GOOD:
        with torch.no_grad():
            want = model(preprocess(Image.open(photos / g), model.preprocess_cfg)[None]).softmax(-1)[0]
        row = rows[str(photos / g)]
        assert np.abs(np.array(row["scores"]) - want[row["indices"]].numpy()).max() <= 1e-5
    assert run(ckpt, photos, "--out", out, "--tome", "0", "--decode", "exact", "--top-k", "10") == 1


def test_the_formats_hold_the_same_rows(onnx, photos, tmp_path):
    got = {}
    for fmt in ("jsonl", "csv", "parquet"):
        assert run(onnx, photos, "--out", tmp_path / f"p.{fmt}", "--batch-size", "2") == 0
        got[fmt] = by_path(read_rows(tmp_path / f"p.{fmt}"))
    assert got["jsonl"] == got["csv"] == got["parquet"]  # repr round-trips floats exactly


def _classify(ready_client, settings, files: list[Path]) -> list[list[dict]]:
    with ready_client(settings) as client:
        answers = []
        for f in files:
            r = client.post("/classify?top_k=5", files={"file": (f.name, f.read_bytes(), "image/jpeg")})
            assert r.status_code == 200, r.text
            answers.append(r.json()["predictions"])
    return answers


@pytest.mark.parametrize("kind", ["onnx", "checkpoint"])
def test_scores_equal_the_gateways_classify(kind, onnx, ckpt, photos, tmp_path, ready_client):
    """Reference: the real gateway app (create_app, lifespan, batcher) answering POST /classify for each file, on
    its default (fast) decode path, as predict's default. Batch 1 (what sequential requests get): equal bit for
    bit; batch 4: the same classes, scores within 1e-6."""
    from vit_serve.serve.settings import ServeSettings

    model = onnx if kind == "onnx" else ckpt
    files = [photos / g for g in GOOD]
    want = _classify(ready_client, ServeSettings(model=str(model), device="cpu", threads=1), files)
    assert run(model, photos, "--out", tmp_path / "b1.jsonl", "--batch-size", "1", "--threads", "1") == 0
    assert run(model, photos, "--out", tmp_path / "b4.jsonl", "--batch-size", "4", "--threads", "1") == 0
    one, four = by_path(read_rows(tmp_path / "b1.jsonl")), by_path(read_rows(tmp_path / "b4.jsonl"))
    for f, answer in zip(files, want, strict=True):
        assert one[str(f)]["labels"] == [p["label"] for p in answer]
        assert one[str(f)]["indices"] == [p["index"] for p in answer]
        assert one[str(f)]["scores"] == [p["score"] for p in answer]
        assert four[str(f)]["indices"] == one[str(f)]["indices"]
        np.testing.assert_allclose(four[str(f)]["scores"], one[str(f)]["scores"], atol=1e-6)


def _inputs(files: list[Path], cfg: PreprocessConfig) -> torch.Tensor:
    return torch.stack([preprocess(f, cfg.with_decode("fast")) for f in files])


def test_embeddings_and_rollout_maps_equal_the_librarys(ckpt, photos, tmp_path):
    """References: `forward_head(forward_features(x), pre_logits=True)` of the checkpoint loaded by the library, and
    `vit_serve.explain.rollout` of its attentions (default head fusion and discard ratio), on the inputs
    `vit_serve.preprocess` makes on the fast path."""
    from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, rollout

    out = tmp_path / "e.parquet"
    assert run(ckpt, photos, "--out", out, "--embeddings", "--explain", "--batch-size", "3", "--threads", "1") == 0
    rows = read_rows(out)
    maps = np.load(tmp_path / "e.parquet.rollout.npy")
    assert maps.shape == (4, RES[0] // 16, RES[1] // 16)
    model = vit_serve.load(ckpt).eval()
    files = [Path(r["path"]) for r in rows]
    with torch.no_grad():
        x = _inputs(files, model.preprocess_cfg)
        emb = model.forward_head(model.forward_features(x), pre_logits=True)
        _, attentions = model(x, return_attention=True)
        heat = rollout(attentions, (RES[0] // 16, RES[1] // 16), model.num_prefix_tokens, model.cfg.pool,
                       DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO).map
    # the space of these vectors, from the library's model: its weights, config and contract at fp32, not normalised
    space = embedding_space_of(weights_digest(model.state_dict()), model.cfg, model.preprocess_cfg.with_size(*RES),
                               "fp32")
    for i, r in enumerate(rows):
        np.testing.assert_allclose(r["embedding"], emb[i].numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(maps[r["rollout_index"]], heat[i].numpy(), atol=1e-6)
        assert r["embedding_fingerprint"] == space.fingerprint


def test_normalized_embeddings_equal_timms(photos, tmp_path, randomize):
    """Reference: timm's own ViT (random weights) and its `forward_head(forward_features(x), pre_logits=True)`,
    L2-normalised, against predict on the timm hub folder timm itself writes (converted on load: its config.json
    names the architecture)."""
    timm = pytest.importorskip("timm")
    from timm.models import save_for_hf

    ref = randomize(timm.create_model("vit_tiny_patch16_224", num_classes=10, depth=2, img_size=32), seed=5)
    path = tmp_path / "timm_tiny"
    save_for_hf(ref, str(path), safe_serialization=True)
    out = tmp_path / "t.jsonl"
    assert run(path, photos, "--out", out, "--embeddings", "--normalize", "--threads", "1") == 0
    rows = read_rows(out)
    cfg = vit_serve.load(path).preprocess_cfg
    with torch.no_grad():
        x = _inputs([Path(r["path"]) for r in rows], cfg)
        want = torch.nn.functional.normalize(ref.forward_head(ref.forward_features(x), pre_logits=True), dim=1)
        logits = ref(x)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(r["embedding"], want[i].numpy(), atol=1e-5)
        assert r["indices"] == torch.argsort(logits[i], descending=True)[:5].tolist()


def test_embeddings_of_an_export_without_them_is_one_line(onnx, photos, tmp_path, capsys):
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

    assert OnnxRuntimeBackend(onnx, device="cpu", threads=1).info.embedding_dim == 0  # exported without it
    assert run(onnx, photos, "--out", tmp_path / "x.jsonl", "--embeddings") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no embedding output" in err


def test_a_repository_folder_and_model_name(onnx, ckpt, photos, tmp_path, capsys):
    """REPO as `vit-serve serve` reads it: NAME/VERSION/ folders; --model picks one, at its newest version."""
    import shutil

    repo = tmp_path / "repo"
    for v, src in ((1, ckpt), (2, onnx)):
        (repo / "pets" / str(v)).mkdir(parents=True)
        for f in src.parent.glob(src.stem + "*"):
            shutil.copy(f, repo / "pets" / str(v) / f.name)
    shutil.copy(ckpt, repo / "other.safetensors")
    assert run(repo, photos, "--out", tmp_path / "r.jsonl") == 1
    assert "pick one with --model NAME" in capsys.readouterr().err
    assert run(repo, photos, "--out", tmp_path / "r.jsonl", "--model", "pets") == 0
    manifest = json.loads((tmp_path / "r.jsonl.manifest.json").read_text())
    assert manifest["key"]["version"] == 2 and manifest["backend"] == "onnxruntime"


def test_another_model_is_refused_unless_forced(onnx, ckpt, photos, tmp_path, capsys):
    out = tmp_path / "p.csv"
    assert run(onnx, photos, "--out", out) == 0
    assert run(ckpt, photos, "--out", out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_sha256" in err and "--force" in err
    assert run(ckpt, photos, "--out", out, "--top-k", "2", "--force") == 0
    assert len(read_rows(out)[0]["labels"]) == 2
    (tmp_path / "mine.jsonl").write_text('{"a": 1}\n')  # somebody else's file
    assert run(onnx, photos, "--out", tmp_path / "mine.jsonl") == 1
    assert "not written by vit-serve predict" in capsys.readouterr().err


def test_nothing_readable_exits_1(onnx, tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(b"\xff\xd8 not really")
    (tmp_path / "imgs" / "b.png").write_bytes(b"")
    assert run(onnx, tmp_path / "imgs", "--out", tmp_path / "p.jsonl") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 2 files could be read" in err[0]


def _many(folder: Path, n: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (24, 36, 3), dtype=np.uint8)).save(folder / f"{i:04d}.jpg")


def _rows_on_disk(out: Path) -> int:
    if out.suffix == ".jsonl":
        return out.read_bytes().count(b"\n") if out.exists() else 0
    return len(list(out.glob("part-*.parquet"))) if out.exists() else 0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_resume_after_sigkill_loses_nothing_and_duplicates_nothing(fmt, onnx, tmp_path):
    """A real `vit-serve predict` process killed with SIGKILL mid-run, a torn last line (JSONL) or a half-written
    part (Parquet) left behind as a kill mid-write leaves them, then a rerun: every image exactly once, each row
    equal to an uninterrupted run's."""
    _many(tmp_path / "imgs", 400)
    out = tmp_path / f"p.{fmt}"
    cmd = [sys.executable, "-m", "vit_serve", "predict", str(onnx), str(tmp_path / "imgs"), "--out", str(out),
           "--batch-size", "1", "--workers", "1", "--threads", "1", "--part-rows", "4", "--quiet"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _rows_on_disk(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed: {proc.stderr.read()}"
    if fmt == "jsonl":
        with open(out, "ab") as f:
            f.write(b'{"path": "' + str(tmp_path).encode() + b'/imgs/03')  # torn mid-row
    else:
        (out / ".part-000999.parquet.tmp").write_bytes(b"PAR1 half a part")
    before = len(by_path(read_rows(out))) if fmt == "parquet" else out.read_bytes().count(b"\n")
    assert 0 < before < 400
    assert main(["predict", str(onnx), str(tmp_path / "imgs"), "--out", str(out), "--batch-size", "1",
                 "--threads", "1", "--quiet"]) == 0
    rows = by_path(read_rows(out))
    assert set(rows) == {str(p) for p in (tmp_path / "imgs").glob("*.jpg")}
    assert run(onnx, tmp_path / "imgs", "--out", tmp_path / f"clean.{fmt}", "--batch-size", "1",
               "--threads", "1") == 0
    assert rows == by_path(read_rows(tmp_path / f"clean.{fmt}"))


def test_explain_resumes_with_consistent_map_indices(ckpt, photos, tmp_path):
    """A map appended for a row that a kill then lost stays in the .npy unreferenced; every row still names its
    own map after the rerun (reference: the maps of an uninterrupted run, by path)."""
    out = tmp_path / "x.jsonl"
    assert run(ckpt, photos, "--out", out, "--explain", "--batch-size", "1", "--threads", "1") == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]))  # the last two rows lost after their maps were written
    assert run(ckpt, photos, "--out", out, "--explain", "--batch-size", "1", "--threads", "1") == 0
    rows, maps = by_path(read_rows(out)), np.load(tmp_path / "x.jsonl.rollout.npy")
    assert len(rows) == 4 and len(maps) == 6
    assert run(ckpt, photos, "--out", tmp_path / "clean.jsonl", "--explain", "--batch-size", "1",
               "--threads", "1") == 0
    clean, clean_maps = by_path(read_rows(tmp_path / "clean.jsonl")), np.load(tmp_path / "clean.jsonl.rollout.npy")
    for path, r in rows.items():
        np.testing.assert_array_equal(maps[r["rollout_index"]], clean_maps[clean[path]["rollout_index"]])


def test_decode_in_processes_gives_the_same_rows(onnx, photos, tmp_path):
    assert run(onnx, photos, "--out", tmp_path / "t.jsonl", "--workers", "2", "--threads", "1") == 0
    assert run(onnx, photos, "--out", tmp_path / "p.jsonl", "--workers", "2", "--processes", "--threads", "1") == 0
    assert by_path(read_rows(tmp_path / "t.jsonl")) == by_path(read_rows(tmp_path / "p.jsonl"))


def test_importing_predict_does_not_import_ray_and_ray_missing_is_one_line(onnx, photos, tmp_path):
    code = "import sys, vit_serve.predict; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = ("import sys; sys.modules['ray'] = None\n"  # import ray now raises ImportError, as without the package
            "from vit_serve.cli import main\n"
            f"sys.exit(main(['predict', {str(onnx)!r}, {str(photos)!r}, '--out', {str(tmp_path / 'r.parquet')!r},"
            " '--engine', 'ray']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "vit-serve[ray]" in p.stderr, p.stderr


def test_bad_flags_are_one_line(onnx, photos, tmp_path, capsys):
    assert run(onnx, photos, "--out", tmp_path / "p.txt") == 1
    assert "expected a .jsonl, .csv or .parquet" in capsys.readouterr().err
    assert run(onnx, photos, "--out", tmp_path / "p.csv", "--normalize") == 1
    assert "--normalize applies to --embeddings" in capsys.readouterr().err
    assert run(onnx, photos, "--out", tmp_path / "p.csv", "--batch-size", "0") == 1
    assert run(onnx, tmp_path / "nowhere", "--out", tmp_path / "p.csv") == 1
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["predict", str(onnx)])
    assert e.value.code == 2


# ---- names and labels that are not plain text ----------------------------------------------------------------

ODD = ("line\u2028sep", "para\u2029sep", "next\u0085line")  # str.splitlines() breaks at each of these


@pytest.fixture(scope="module")
def odd_ckpt(tmp_path_factory, save_tiny) -> Path:
    """The tiny model with labels that hold U+2028, U+2029 and U+0085."""
    labels = [*ODD, *LABELS[len(ODD):]]
    return save_tiny(tmp_path_factory.mktemp("odd") / "odd.safetensors", RES, 4, labels)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_line_separators_in_paths_and_labels_round_trip_and_resume(fmt, odd_ckpt, tmp_path):
    """Real files named with U+2028, U+2029, U+0085, a label set holding them, every label in every row (top 10):
    written, resumed (nothing redone, nothing refused), read back by the reference readers; a text file listing
    the same paths lists the same images."""
    _many(tmp_path / "imgs", 4)
    for i, odd in enumerate(ODD):
        os.rename(tmp_path / "imgs" / f"{i:04d}.jpg", tmp_path / "imgs" / f"{odd}.jpg")
    files = sorted(str(p) for p in (tmp_path / "imgs").iterdir())
    (tmp_path / "list.txt").write_text("".join(f"imgs/{Path(f).name}\n" for f in files), encoding="utf-8")
    assert sorted(i.path for i in list_images(str(tmp_path / "list.txt"))) == files
    out = tmp_path / f"p.{fmt}"
    assert run(odd_ckpt, tmp_path / "imgs", "--out", out, "--top-k", "10", "--threads", "1") == 0
    first = by_path(read_rows(out))
    assert sorted(first) == files
    for row in first.values():
        assert set(ODD) <= set(row["labels"])
    result = predict(PredictOptions(str(odd_ckpt), str(tmp_path / "list.txt"), str(out), top_k=10, threads=1,
                                    quiet=True))
    assert (result.written, result.skipped, result.rows) == (0, 4, 4)
    assert by_path(read_rows(out)) == first


def _non_utf8_folder(folder: Path) -> tuple[Path, str]:
    """Two JPEGs, one named with the Latin-1 byte 0xE9 (not UTF-8), made through a bytes path as Linux allows;
    returns the folder and that file's name as Python lists it (surrogateescape: 'caf\\udce9.jpg')."""
    _many(folder, 2)
    data = (folder / "0000.jpg").read_bytes()
    (folder / "0000.jpg").unlink()
    fd = os.open(os.fsencode(folder) + b"/caf\xe9.jpg", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return folder, os.path.join(folder, os.fsdecode(b"caf\xe9.jpg"))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_file_name_that_is_not_utf8_never_aborts_the_run(fmt, onnx, tmp_path):
    """JSONL keeps its row, the name escaped as JSON's \\udce9 (valid UTF-8 text; `json.loads` gives back the name
    that opens the file, so resume skips it); CSV and Parquet, whose text is UTF-8, list it in OUT.errors.jsonl
    with why, and write the other rows. Reference readers: json, csv, pyarrow + pandas."""
    folder, odd = _non_utf8_folder(tmp_path / "imgs")
    out = tmp_path / f"p.{fmt}"
    opts = PredictOptions(str(onnx), str(folder), str(out), threads=1, quiet=True)
    result = predict(opts)
    rows = by_path(read_rows(out))
    errors = [json.loads(line) for line in sidecar(out, "errors.jsonl").read_bytes().split(b"\n") if line] \
        if sidecar(out, "errors.jsonl").exists() else []
    if fmt == "jsonl":
        assert sorted(rows) == sorted([odd, str(folder / "0001.jpg")]) and not errors
        assert b"caf\\udce9.jpg" in out.read_bytes()
        out.read_bytes().decode("utf-8")  # the file is UTF-8 text
        with open(odd.encode("utf-8", "surrogateescape"), "rb") as f:
            assert f.read(2) == b"\xff\xd8"  # the name read back opens the file
    else:
        assert list(rows) == [str(folder / "0001.jpg")]
        assert [e["path"] for e in errors] == [odd] and "not UTF-8" in errors[0]["error"]
        assert result.written == 1 and result.errors
    again = predict(opts)
    assert again.written == 0 and again.rows == len(rows)


def _timm_folder(folder: Path, seed: int, randomize) -> Path:
    """timm's hub layout (config.json + model.safetensors) of a random 2-block Ti/16 at 32x32."""
    import timm
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    ref = randomize(timm.create_model("vit_tiny_patch16_224", num_classes=3, depth=2, img_size=32), seed=seed)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, folder / "model.safetensors")
    cfg = {"architecture": "vit_tiny_patch16_224", "num_classes": 3, "label_names": ["cat", "dog", "fox"],
           "pretrained_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 1.0, "interpolation": "bilinear",
                              "input_size": [3, 32, 32]}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_folder_models_key_is_its_weights_not_its_stat(tmp_path, capsys, randomize):
    """Touching the folder, or copying it elsewhere, resumes; new weights in place, with the file's and the
    folder's times put back as they were, are refused without --force."""
    _many(tmp_path / "imgs", 2)
    model = _timm_folder(tmp_path / "a" / "vit", 1, randomize)
    out = tmp_path / "p.jsonl"
    assert run(model, tmp_path / "imgs", "--out", out, "--threads", "1") == 0
    os.utime(model, ns=(10**18, 10**18))  # touched
    assert run(model, tmp_path / "imgs", "--out", out, "--threads", "1") == 0, capsys.readouterr().err
    copy = tmp_path / "b" / "vit"
    shutil.copytree(model, copy, copy_function=shutil.copyfile)
    os.utime(copy, ns=(2 * 10**18, 2 * 10**18))
    assert run(copy, tmp_path / "imgs", "--out", out, "--threads", "1") == 0, capsys.readouterr().err
    capsys.readouterr()
    weights = model / "model.safetensors"
    st, folder_st = weights.stat(), model.stat()
    other = _timm_folder(tmp_path / "other", 2, randomize) / "model.safetensors"
    assert other.stat().st_size == st.st_size and other.read_bytes() != weights.read_bytes()
    with open(weights, "r+b") as f:  # rewritten in place: the folder's entries (and times) do not change
        f.write(other.read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(model, ns=(folder_st.st_atime_ns, folder_st.st_mtime_ns))
    assert run(model, tmp_path / "imgs", "--out", out, "--threads", "1") == 1
    err = capsys.readouterr().err
    assert "model_sha256" in err and "--force" in err
    assert run(model, tmp_path / "imgs", "--out", out, "--threads", "1", "--force") == 0


def _cache_snapshot(cache: Path, repo: str, commit: str, folder: Path) -> None:
    """`folder` as the hub cache holds `repo` at `commit` (refs/main names the snapshot), as huggingface_hub lays
    it out; offline, `snapshot_download` answers with that snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs" / "main").write_text(commit)


def test_a_hub_ids_key_is_its_weights(tmp_path, capsys, randomize, monkeypatch):
    """A hub id (through huggingface_hub's real cache, offline): resumed while its weights stay, refused once the
    hub's newest revision has other weights."""
    import huggingface_hub.constants as c

    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    _many(tmp_path / "imgs", 2)
    _cache_snapshot(cache, "vit-serve-tests/tiny", "a" * 40, _timm_folder(tmp_path / "r1", 1, randomize))
    out = tmp_path / "p.jsonl"
    assert run("hf-hub:vit-serve-tests/tiny", tmp_path / "imgs", "--out", out, "--threads", "1") == 0, \
        capsys.readouterr().err
    assert run("hf-hub:vit-serve-tests/tiny", tmp_path / "imgs", "--out", out, "--threads", "1") == 0
    _cache_snapshot(cache, "vit-serve-tests/tiny", "b" * 40, _timm_folder(tmp_path / "r2", 2, randomize))
    capsys.readouterr()
    assert run("hf-hub:vit-serve-tests/tiny", tmp_path / "imgs", "--out", out, "--threads", "1") == 1
    assert "model_sha256" in capsys.readouterr().err
