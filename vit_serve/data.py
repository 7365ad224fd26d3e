"""Datasets. The embedded default: scikit-learn's handwritten digits (real 8x8 scans shipped inside
scikit-learn, no download), upscaled to any resolution by the one preprocessing function.

For training: :class:`ImageFolder` (``root/<class>/<image>``), :class:`CIFAR` (CIFAR-10/100 from their local
python-format files, read through a restricted unpickler), :class:`Digits` (the digits through the same
transform path as any image set), :func:`build_dataset` (a dataset from a spec string) and
:func:`collate_skip` (drops unreadable images and counts them). Every image is decoded by
:func:`~vit_serve.preprocess.load_image`; the transforms come from ``vit_serve.train.augment``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate

from vit_serve.preprocess import (
    ImageDecodeError,
    ImageTooLargeError,
    PreprocessConfig,
    load_image,
    preprocess_batch,
)

DIGITS_LABELS = [str(i) for i in range(10)]


def digits_arrays(split: str, seed: int = 0, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """The digits set as uint8 images [N, 8, 8] (0..255) and labels [N], with a fixed stratified split.

    split: "train" or "test"; the split depends only on `seed` and `test_fraction` (1438 / 359 by default).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("the digits dataset needs scikit-learn: pip install scikit-learn") from e
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):  # stratified: the same fraction of every class
        idx = rng.permutation(np.flatnonzero(labels == c))
        test[idx[: round(len(idx) * test_fraction)]] = True
    keep = test if split == "test" else ~test
    return images[keep], labels[keep]


def digits_images(split: str, seed: int = 0) -> tuple[list[Image.Image], np.ndarray]:
    """The digits as 8x8 greyscale PIL images (white strokes on black) and their labels."""
    images, labels = digits_arrays(split, seed)
    return [Image.fromarray(a, mode="L") for a in images], labels


def digits_tensors(split: str, cfg: PreprocessConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Model inputs [N, 3, H, W] (upscaled by `preprocess`, per the contract `cfg`) and labels [N]."""
    images, labels = digits_images(split, seed)
    return preprocess_batch(images, cfg), torch.from_numpy(labels)


IMAGE_SUFFIXES: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # what find_images lists


def find_images(directory: str | os.PathLike) -> list[Path]:
    """The image files (jpg, jpeg, png, bmp, webp; any case) directly in `directory`, sorted by name.

    Raises NotADirectoryError / FileNotFoundError for a bad directory, ValueError when it holds no images.
    """
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"image folder {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is not a folder")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"no image files ({', '.join(s[1:] for s in IMAGE_SUFFIXES)}) in {d}")
    return files


# --------------------------------------------------------------------------------------------------------
# Datasets for training: image folders, CIFAR-10/100, the digits through the common transform path
# --------------------------------------------------------------------------------------------------------

IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
DATASET_SPECS = (
    '"digits" (the embedded scikit-learn digits)',
    '"cifar10:<path>" or "cifar100:<path>" (the python-format CIFAR folder or its parent)',
    '"<dir>" (an image-folder root with train/<class>/<image> and val/<class>/<image>)',
)

Transform = Callable[[Any], Any]


class DataError(ValueError):
    """A dataset could not be found, read or understood (one-line message naming the path)."""


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _class_dirs(root: Path) -> list[str]:
    """Sorted names of the non-hidden sub-folders of ``root``."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not _hidden(e.name))


class ImageFolder(Dataset):
    """Images stored as ``root/<class>/<image>`` (sub-folders inside a class folder are included).

    Classes are the sorted names of the non-hidden sub-folders of ``root``, or ``classes`` when given (then
    every class folder present must be one of them; missing ones simply have no images, so a val/ split can
    share train/'s label indices). Files are those with an extension in :data:`IMAGE_EXTENSIONS` (any case);
    hidden files and folders are ignored.

    ``dataset[i]`` is ``(transform(rgb_pil_image), label)``, decoded by :func:`~vit_serve.preprocess.load_image`
    (EXIF orientation, every mode to RGB); ``transform=None`` returns the PIL image itself. A file that cannot
    be read or decoded gives ``None`` (drop it with :func:`collate_skip`), or with ``strict=True`` raises
    :class:`DataError` naming the file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Transform | None = None,
        strict: bool = False,
        classes: Sequence[str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.transform = transform
        self.strict = strict
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} does not exist or is not a directory")
        found = _class_dirs(self.root)
        if classes is None:
            if not found:
                raise DataError(f"no class folders in {self.root}: expected {self.root}/<class>/<image> files")
            self.classes = found
        else:
            self.classes = list(classes)
            unknown = sorted(set(found) - set(self.classes))
            if unknown:
                raise DataError(f"class folders in {self.root} not among the given classes: {', '.join(unknown)}")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in found:
            label = self.class_to_idx[name]
            for dirpath, dirnames, filenames in os.walk(self.root / name, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not _hidden(d))  # walk order is deterministic
                for f in sorted(filenames):
                    if not _hidden(f) and f.lower().endswith(IMAGE_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, f), label))
        if not self.samples:
            exts = ", ".join(e[1:] for e in IMAGE_EXTENSIONS)
            raise DataError(f"no images found under {self.root} (looked for {exts} in {self.root}/<class>/)")
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        path, label = self.samples[index]
        try:
            img = load_image(path)
        except (ImageDecodeError, ImageTooLargeError, OSError) as e:
            if self.strict:
                reason = " ".join(str(e).split()) or type(e).__name__
                raise DataError(f"cannot read image {path}: {reason}") from e
            return None
        return (img if self.transform is None else self.transform(img)), label

    def __repr__(self) -> str:
        return f"ImageFolder({str(self.root)!r}, {len(self.samples)} images, {len(self.classes)} classes)"


# CIFAR's python-format files are pickles of plain dicts of bytes, lists, ints and numpy arrays. Unpickling
# runs whatever callables the file names, so a tampered or hostile file could execute arbitrary code; the
# loader below only resolves the few globals such dicts need (numpy's array / dtype reconstruction and, for
# protocol-2 files written by Python 3, the latin-1 bytes codec) and refuses everything else.


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes``, restricted to latin-1."""
    if encoding.lower().replace("-", "").replace("_", "") not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return str(text).encode("latin1")


def _numpy_pickle_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray, numeric  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{mod}.multiarray", "scalar")] = multiarray.scalar
        if hasattr(numeric, "_frombuffer"):  # protocol-5 pickles of arrays
            allowed[(f"{mod}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only numpy's array-reconstruction globals (see the comment above)."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path
        self._allowed = _numpy_pickle_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None:
            raise DataError(
                f"refusing to unpickle {module}.{name} from {self._path}: CIFAR files hold only numpy arrays, "
                "bytes, lists and dicts, and arbitrary objects are never unpickled"
            )
        return obj


def load_cifar_batch(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One CIFAR python-format file (a batch or the meta file) as a dict with ``str`` keys.

    Loaded as ``pickle.load(f, encoding="bytes")`` through a restricted unpickler that allows only numpy's
    array-reconstruction globals; any other global (e.g. ``os.system``) raises :class:`DataError`.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f, path).load()
    except DataError:
        raise
    except FileNotFoundError as e:
        raise DataError(f"missing CIFAR file {path}") from e
    except OSError as e:
        raise DataError(f"cannot read CIFAR file {path}: {e.strerror or e}") from e
    except Exception as e:  # truncated / not a pickle: UnpicklingError, EOFError, ValueError, ...
        raise DataError(f"{path} is not a CIFAR python-format file ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise DataError(f"{path} is not a CIFAR python-format file (holds a {type(obj).__name__}, not a dict)")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


_CIFAR_LAYOUT = {
    # variant: (folder, train files, test files, meta file, label key, label-names key, number of classes)
    "cifar10": (
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "batches.meta",
        "labels",
        "label_names",
        10,
    ),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "meta", "fine_labels", "fine_label_names", 100),
}


class CIFAR(Dataset):
    """CIFAR-10 / CIFAR-100 from their local python-format files (never downloaded).

    ``root`` is the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``) or its parent.
    ``dataset[i]`` is ``(transform(32x32 RGB PIL image), label)`` (``transform=None``: the PIL image);
    CIFAR-100 uses the 100 fine labels. ``.classes`` are the label names from the meta file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str = "train",
        transform: Transform | None = None,
        variant: str = "cifar10",
    ) -> None:
        if variant not in _CIFAR_LAYOUT:
            raise DataError(f"unknown CIFAR variant {variant!r}; expected cifar10 or cifar100")
        if split not in ("train", "test"):
            raise DataError(f"CIFAR split must be 'train' or 'test', got {split!r}")
        folder, train_files, test_files, meta_file, label_key, names_key, num_classes = _CIFAR_LAYOUT[variant]
        root = Path(root)
        base = root if (root / meta_file).is_file() else root / folder
        if not (base / meta_file).is_file():
            raise DataError(
                f"no {variant} data at {root}: expected {root}/{meta_file} or {root}/{folder}/{meta_file} "
                "(the extracted python-format archive)"
            )
        self.root, self.split, self.transform, self.variant = base, split, transform, variant

        meta = load_cifar_batch(base / meta_file)
        names = meta.get(names_key)
        if not isinstance(names, (list, tuple)) or len(names) != num_classes:
            raise DataError(f"{base / meta_file}: expected {num_classes} names under {names_key!r}")
        self.classes = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]

        datas, labels = [], []
        for name in train_files if split == "train" else test_files:
            path = base / name
            batch = load_cifar_batch(path)
            if "data" not in batch or label_key not in batch:
                raise DataError(f"{path}: missing the 'data' or {label_key!r} entry")
            data = batch["data"]
            if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
                raise DataError(f"{path}: 'data' must be a uint8 array [N, 3072], got {_describe(data)}")
            lab = np.asarray(batch[label_key], dtype=np.int64).reshape(-1)
            if len(lab) != len(data):
                raise DataError(f"{path}: {len(data)} images but {len(lab)} labels")
            if len(lab) and (lab.min() < 0 or lab.max() >= num_classes):
                raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
            datas.append(data)
            labels.append(lab)
        # Rows are 1024 red, 1024 green, 1024 blue values, each plane row-major: -> [N, 32, 32, 3].
        self.data = np.concatenate(datas).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy()
        self.targets = np.concatenate(labels)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img = Image.fromarray(self.data[index], mode="RGB")
        return (img if self.transform is None else self.transform(img)), int(self.targets[index])

    def __repr__(self) -> str:
        return f"CIFAR({str(self.root)!r}, variant={self.variant!r}, split={self.split!r}, {len(self)} images)"


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {list(x.shape)}"
    return type(x).__name__


class Digits(Dataset):
    """The digits set as a dataset of ``(transform(8x8 greyscale PIL image), label)``.

    The same transform path as any image dataset: the transform (e.g. ``train_transform`` / ``eval_transform``)
    decodes to RGB and resizes to the model resolution. Split as :func:`digits_arrays` (fixed by ``seed``).
    """

    def __init__(self, split: str = "train", transform: Transform | None = None, seed: int = 0) -> None:
        self.images, labels = digits_images(split, seed)
        self.targets = labels
        self.split, self.transform, self.seed = split, transform, seed
        self.classes = list(DIGITS_LABELS)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img = self.images[index]
        return (img if self.transform is None else self.transform(img)), int(self.targets[index])

    def __repr__(self) -> str:
        return f"Digits(split={self.split!r}, seed={self.seed}, {len(self)} images)"


def _spec_error(spec: str, why: str) -> DataError:
    forms = "; ".join(DATASET_SPECS)
    return DataError(f"dataset {spec!r}: {why}. Accepted forms: {forms}")


def build_dataset(spec: str, split: str, transform: Transform | None = None, strict: bool = False) -> Dataset:
    """The dataset named by ``spec`` (see :data:`DATASET_SPECS`) for ``split`` = "train", "test" or "val".

    "test" and "val" are the same split: CIFAR's and digits' test set, an image folder's ``val/``. An image
    folder's ``val/`` uses ``train/``'s class list when there is one, so label indices agree. ``strict`` is
    passed to :class:`ImageFolder`.
    """
    if not isinstance(spec, str) or not spec:
        raise _spec_error(str(spec), "expected a non-empty string")
    if split not in ("train", "test", "val"):
        raise DataError(f"split must be 'train', 'test' or 'val', got {split!r}")
    is_train = split == "train"
    if spec == "digits":
        return Digits("train" if is_train else "test", transform)
    variant, sep, path = spec.partition(":")
    if sep and variant in _CIFAR_LAYOUT:
        if not path:
            raise _spec_error(spec, f"{variant} needs a path")
        return CIFAR(Path(path).expanduser(), "train" if is_train else "test", transform, variant)
    root = Path(spec).expanduser()
    if not root.is_dir():
        raise _spec_error(spec, "not a known dataset name and not a directory")
    sub = root / ("train" if is_train else "val")
    if not sub.is_dir():
        raise _spec_error(spec, f"image-folder root without a {sub.name}/ folder")
    classes = None
    if not is_train and (root / "train").is_dir():
        classes = _class_dirs(root / "train") or None
        extra = sorted(set(_class_dirs(sub)) - set(classes or ()))
        if classes and extra:
            raise _spec_error(spec, f"val/ has classes that train/ lacks: {', '.join(extra)}")
    return ImageFolder(sub, transform, strict=strict, classes=classes)


def collate_skip(batch: Sequence[Any]) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Collate ``(image, label)`` items, dropping ``None`` (unreadable images): ``(images, labels, n_skipped)``.

    ``n_skipped`` lets the training loop count skipped files even when they are read in worker processes.
    When every item of the batch was skipped the result is ``(None, None, n_skipped)``; skip such a batch.
    """
    kept = [item for item in batch if item is not None]
    skipped = len(batch) - len(kept)
    if not kept:
        return None, None, skipped
    images, labels = default_collate(kept)
    return images, labels, skipped
