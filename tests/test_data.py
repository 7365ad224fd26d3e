"""Datasets: image folders with real photos and broken files, CIFAR python-format pickles written here (never
downloaded) and the restricted unpickler, the digits through the transform path, build_dataset, collate_skip."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as skdata
from torch.utils.data import DataLoader

from vit_serve.data import (
    CIFAR,
    DIGITS_LABELS,
    DataError,
    Digits,
    ImageFolder,
    build_dataset,
    collate_skip,
    digits_arrays,
    digits_images,
    load_cifar_batch,
)
from vit_serve.preprocess import PreprocessConfig, preprocess
from vit_serve.train.augment import eval_transform

CFG = PreprocessConfig(input_size=(32, 32))


def _photo(name: str, size: tuple[int, int] = (64, 48)) -> Image.Image:
    return Image.fromarray(getattr(skdata, name)()).convert("RGB").resize(size, Image.Resampling.BILINEAR)


def _write_tree(root: Path, broken: bool = True) -> dict[str, Path]:
    """root/<class>/<image>: 5 good photos (JPEG and PNG, upper-case extension, a nested folder), junk files
    that must be ignored, and (``broken``) a truncated JPEG and random bytes named .jpg."""
    (root / "cat" / "more").mkdir(parents=True)
    (root / "coffee").mkdir()
    (root / "person").mkdir()
    (root / ".hidden_class").mkdir()
    _photo("chelsea").save(root / "cat" / "chelsea.jpg", quality=90)
    _photo("chelsea", (40, 40)).save(root / "cat" / "more" / "chelsea_small.PNG")
    _photo("coffee").save(root / "coffee" / "coffee.png")
    _photo("astronaut").save(root / "person" / "astronaut.JPEG", quality=90)
    _photo("astronaut", (30, 50)).save(root / "person" / "astronaut.webp")
    _photo("coffee").save(root / ".hidden_class" / "x.jpg")
    (root / "cat" / ".DS_Store").write_bytes(b"\0\1junk")
    (root / "cat" / "notes.txt").write_text("not an image")
    _photo("chelsea").save(root / "cat" / ".hidden.jpg")
    bad = {}
    if broken:
        full = (root / "cat" / "chelsea.jpg").read_bytes()
        bad["truncated"] = root / "coffee" / "truncated.jpg"
        bad["truncated"].write_bytes(full[: len(full) // 2])
        bad["random"] = root / "person" / "random.jpg"
        bad["random"].write_bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    return bad


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("images")
    return root, _write_tree(root)


# --------------------------------------------------------------------------------------------------------
# ImageFolder
# --------------------------------------------------------------------------------------------------------


def test_image_folder_classes_and_samples(tree):
    root, bad = tree
    ds = ImageFolder(root, transform=None)
    assert ds.classes == ["cat", "coffee", "person"]
    names = sorted(Path(p).name for p, _ in ds.samples)
    assert names == sorted(
        ["chelsea.jpg", "chelsea_small.PNG", "coffee.png", "truncated.jpg", "astronaut.JPEG", "astronaut.webp",
         "random.jpg"]
    )  # fmt: skip
    labels = {Path(p).name: y for p, y in ds.samples}
    assert labels["chelsea_small.PNG"] == 0 and labels["coffee.png"] == 1 and labels["astronaut.webp"] == 2
    assert ds.targets == [y for _, y in ds.samples]
    good = [i for i, (p, _) in enumerate(ds.samples) if Path(p) not in bad.values()]
    img, label = ds[good[0]]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and label == ds.samples[good[0]][1]


def test_image_folder_transform_is_preprocess(tree):
    root, _ = tree
    ds = ImageFolder(root, eval_transform(CFG))
    i = next(i for i, (p, _) in enumerate(ds.samples) if p.endswith("coffee.png"))
    x, y = ds[i]
    assert y == 1 and x.shape == (3, 32, 32)
    torch.testing.assert_close(x, preprocess(ds.samples[i][0], CFG), rtol=0, atol=0)


def test_image_folder_bad_files_none_or_strict(tree):
    root, bad = tree
    ds = ImageFolder(root, eval_transform(CFG))
    index = {Path(p): i for i, (p, _) in enumerate(ds.samples)}
    for path in bad.values():
        assert ds[index[path]] is None
    strict = ImageFolder(root, eval_transform(CFG), strict=True)
    for path in bad.values():
        with pytest.raises(DataError, match=path.name):
            strict[index[path]]


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_skip_counts_bad_files_over_a_loader(tree, workers):
    root, _ = tree
    ds = ImageFolder(root, eval_transform(CFG))
    loader = DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=collate_skip)
    seen, skipped, labels = 0, 0, []
    for images, y, n in loader:
        skipped += n
        if images is None:
            continue
        assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32 and y.dtype == torch.int64
        seen += len(images)
        labels += y.tolist()
    assert skipped == 2 and seen == len(ds) - 2
    assert sorted(labels) == [0, 0, 1, 2, 2]


def test_collate_skip_all_skipped_and_plain():
    assert collate_skip([None, None]) == (None, None, 2)
    images, labels, n = collate_skip([(torch.zeros(3, 4, 4), 1), None, (torch.ones(3, 4, 4), 7)])
    assert images.shape == (2, 3, 4, 4) and labels.tolist() == [1, 7] and n == 1


def test_image_folder_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ImageFolder(tmp_path / "missing", None)
    with pytest.raises(DataError, match="no class folders"):
        ImageFolder(tmp_path, None)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="no images found"):
        ImageFolder(tmp_path, None)
    _photo("coffee").save(tmp_path / "a" / "c.png")
    with pytest.raises(DataError, match="not among the given classes: a"):
        ImageFolder(tmp_path, None, classes=["b"])
    ds = ImageFolder(tmp_path, None, classes=["0", "a", "b"])
    assert ds.samples[0][1] == 1 and ds.classes == ["0", "a", "b"]


# --------------------------------------------------------------------------------------------------------
# CIFAR
# --------------------------------------------------------------------------------------------------------


def _cifar_rows(images: np.ndarray) -> np.ndarray:
    """[N, 32, 32, 3] -> CIFAR's [N, 3072] rows (1024 red, 1024 green, 1024 blue values)."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


class _Py2Pickler(pickle._Pickler):
    """Writes what Python 2's cPickle wrote for the real CIFAR files: protocol 2, str and bytes as BINSTRING,
    numpy 1's module paths (``numpy.core.multiarray._reconstruct``)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: str | bytes) -> None:
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        n = len(data)
        self.write(
            pickle.SHORT_BINSTRING + bytes([n]) + data if n < 256 else pickle.BINSTRING + struct.pack("<i", n) + data
        )
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str

    def save_global(self, obj, name=None) -> None:
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


def _dump(path: Path, obj: dict, protocol: int | str) -> None:
    with open(path, "wb") as f:
        if protocol == "py2":
            _Py2Pickler(f, protocol=2).dump(obj)
        else:
            pickle.dump(obj, f, protocol=protocol)


def _write_cifar10(parent: Path, n_per_batch: int = 4, n_test: int = 6, protocol: int | str = "py2") -> list:
    """A fake cifar-10-batches-py (keys as bytes, like the real Python 2 pickles); returns the train images."""
    rng = np.random.default_rng(10)
    base = parent / "cifar-10-batches-py"
    base.mkdir(parents=True)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    _dump(base / "batches.meta", {b"num_cases_per_batch": n_per_batch, b"label_names": names, b"num_vis": 3072},
          protocol)  # fmt: skip
    train = []
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        n = n_test if name == "test_batch" else n_per_batch
        images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        batch = {
            b"batch_label": f"batch {i}".encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": _cifar_rows(images),
            b"filenames": [f"img_{i}_{j}.png".encode() for j in range(n)],
        }
        _dump(base / name, batch, protocol)
        if name != "test_batch":
            train.append((images, batch[b"labels"]))
    return train


def _write_cifar100(parent: Path, n_train: int = 20, n_test: int = 5, protocol: int | str = "py2") -> None:
    rng = np.random.default_rng(100)
    base = parent / "cifar-100-python"
    base.mkdir(parents=True)
    fine = [f"fine_{i}".encode() for i in range(100)]
    coarse = [f"coarse_{i}".encode() for i in range(20)]
    _dump(base / "meta", {b"fine_label_names": fine, b"coarse_label_names": coarse}, protocol)
    for name, n in (("train", n_train), ("test", n_test)):
        batch = {
            b"filenames": [f"{name}_{j}.png".encode() for j in range(n)],
            b"batch_label": name.encode(),
            b"fine_labels": [int(v) for v in rng.integers(0, 100, n)],
            b"coarse_labels": [int(v) for v in rng.integers(0, 20, n)],
            b"data": _cifar_rows(rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)),
        }
        _dump(base / name, batch, protocol)


@pytest.mark.parametrize("protocol", ["py2", 2, pickle.DEFAULT_PROTOCOL, 5])
def test_cifar10_layout_pixels_and_labels(tmp_path, protocol):
    train = _write_cifar10(tmp_path, protocol=protocol)
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):  # the parent or the extracted folder itself
        ds = CIFAR(root, "train", transform=None, variant="cifar10")
        assert len(ds) == 20 and ds.classes[0] == "airplane" and ds.classes[-1] == "truck"
    images = np.concatenate([im for im, _ in train])
    labels = [y for _, ys in train for y in ys]
    for i in (0, 5, 19):
        img, y = ds[i]
        assert img.mode == "RGB" and img.size == (32, 32) and y == labels[i]
        np.testing.assert_array_equal(np.asarray(img), images[i])
    test = CIFAR(tmp_path, "test", eval_transform(PreprocessConfig(input_size=(16, 16))))
    x, y = test[0]
    assert len(test) == 6 and x.shape == (3, 16, 16) and isinstance(y, int)


def test_cifar100(tmp_path):
    _write_cifar100(tmp_path)
    ds = CIFAR(tmp_path, "train", None, variant="cifar100")
    assert len(ds) == 20 and len(ds.classes) == 100 and ds.classes[3] == "fine_3"
    assert all(0 <= ds[i][1] < 100 for i in range(len(ds)))
    assert len(CIFAR(tmp_path / "cifar-100-python", "test", None, variant="cifar100")) == 5


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_cifar_restricted_unpickler_refuses_other_globals(tmp_path):
    _write_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    _dump(batch, {b"data": _Evil(), b"labels": []}, 2)
    with pytest.raises(DataError, match=r"refusing to unpickle (os|posix)\.system from .*data_batch_3"):
        CIFAR(tmp_path, "train", None)
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({b"x": __import__("collections").OrderedDict()}))
    with pytest.raises(DataError, match=r"collections\.OrderedDict"):
        load_cifar_batch(other)


def test_cifar_errors(tmp_path):
    with pytest.raises(DataError, match="no cifar10 data"):
        CIFAR(tmp_path, "train", None)
    _write_cifar10(tmp_path)
    base = tmp_path / "cifar-10-batches-py"
    with pytest.raises(DataError, match="split"):
        CIFAR(tmp_path, "val", None)
    with pytest.raises(DataError, match="variant"):
        CIFAR(tmp_path, "train", None, variant="cifar1000")
    (base / "test_batch").write_bytes(b"\x80\x02}q\x00(")  # truncated pickle
    with pytest.raises(DataError, match="not a CIFAR python-format file"):
        CIFAR(tmp_path, "test", None)
    _dump(base / "test_batch", {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, 2)
    with pytest.raises(DataError, match=r"uint8 array \[N, 3072\]"):
        CIFAR(tmp_path, "test", None)
    _dump(base / "test_batch", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, 2)
    with pytest.raises(DataError, match="2 images but 1 labels"):
        CIFAR(tmp_path, "test", None)
    os.remove(base / "data_batch_5")
    with pytest.raises(DataError, match=r"missing CIFAR file .*data_batch_5"):
        CIFAR(tmp_path, "train", None)


# --------------------------------------------------------------------------------------------------------
# Digits
# --------------------------------------------------------------------------------------------------------


def test_digits_through_the_transform_path():
    ds = Digits("train", eval_transform(CFG))
    assert len(ds) == 1438 and len(Digits("test")) == 359 and ds.classes == DIGITS_LABELS
    images, labels = digits_images("train")
    for i in (0, 100, 1437):
        x, y = ds[i]
        assert x.shape == (3, 32, 32) and y == labels[i]
        torch.testing.assert_close(x, preprocess(images[i], CFG), rtol=0, atol=0)
    raw, _ = Digits("test")[0]
    assert isinstance(raw, Image.Image) and raw.mode == "L" and raw.size == (8, 8)


def test_digits_split_is_fixed_by_the_seed():
    a, b, c = Digits("test", seed=0), Digits("test", seed=0), Digits("test", seed=1)
    arr = lambda ds: np.stack([np.asarray(im) for im in ds.images])  # noqa: E731
    np.testing.assert_array_equal(arr(a), arr(b))
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(arr(a), arr(c))
    np.testing.assert_array_equal(arr(a), digits_arrays("test", seed=0)[0])


# --------------------------------------------------------------------------------------------------------
# build_dataset
# --------------------------------------------------------------------------------------------------------


def test_build_dataset_specs(tmp_path):
    assert isinstance(build_dataset("digits", "train", None), Digits)
    assert len(build_dataset("digits", "val", None)) == len(build_dataset("digits", "test", None)) == 359
    _write_cifar10(tmp_path / "c10")
    _write_cifar100(tmp_path / "c100")
    assert len(build_dataset(f"cifar10:{tmp_path / 'c10'}", "train", None)) == 20
    assert len(build_dataset(f"cifar10:{tmp_path / 'c10'}", "val", None)) == 6
    c100 = build_dataset(f"cifar100:{tmp_path / 'c100' / 'cifar-100-python'}", "test", None)
    assert isinstance(c100, CIFAR) and c100.variant == "cifar100" and len(c100) == 5

    folder = tmp_path / "folder"
    _write_tree(folder / "train", broken=False)
    (folder / "val" / "person").mkdir(parents=True)  # val/ lacks "cat" and "coffee": labels follow train/
    _photo("astronaut").save(folder / "val" / "person" / "a.jpg")
    train = build_dataset(str(folder), "train", None, strict=True)
    assert isinstance(train, ImageFolder) and len(train) == 5 and train.strict
    for split in ("val", "test"):
        val = build_dataset(str(folder), split, None)
        assert val.classes == train.classes and val.samples[0][1] == train.classes.index("person")


def test_build_dataset_errors(tmp_path):
    with pytest.raises(DataError, match="split"):
        build_dataset("digits", "holdout", None)
    with pytest.raises(DataError, match=r"'imagenet'.*Accepted forms: .*digits.*cifar10:<path>.*train/"):
        build_dataset("imagenet", "train", None)
    with pytest.raises(DataError, match="cifar10 needs a path"):
        build_dataset("cifar10:", "train", None)
    with pytest.raises(DataError, match="no cifar100 data"):
        build_dataset(f"cifar100:{tmp_path}", "train", None)
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match=r"without a val/ folder.*Accepted forms"):
        build_dataset(str(tmp_path), "val", None)
    (tmp_path / "val" / "b").mkdir(parents=True)
    with pytest.raises(DataError, match="val/ has classes that train/ lacks: b"):
        build_dataset(str(tmp_path), "val", None)
