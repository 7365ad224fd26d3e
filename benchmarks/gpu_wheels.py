"""The wheels the GPU check carries to a machine without network, and their installation there.

    python benchmarks/gpu_wheels.py            # here, with PyPI: fill .gpu-wheels/ (git-ignored), print its size

The GPU machine's Python holds torch, timm, onnx, onnxruntime, transformers and pytest (MACHINE_HOLDS) but not
the gateway's web stack, and at most 64 MiB travels with the working tree. What is carried: the requirement
closure of CARRIED_ROOTS less that of RELIED_ON, each at the version installed here (the one the tests
pass with), downloaded with `pip download --no-deps --only-binary=:all:`; the few compiled ones (pydantic-core,
grpcio, python-rapidjson) once per Python of CARRY_PYTHONS, since the machine's Python is not known here. Also
the photos the upload corpus is made of (benchmarks/upload_corpus.py), as PNG files in photos/: scikit-image and
matplotlib, where they come from, are too large to travel. What cannot travel at all (TensorRT's wheels are over
a gigabyte, scikit-image needs SciPy) is in NOT_CARRIED: a stage needing it is "not available here".

There, `install(folder, target)` installs the carried wheels that the machine lacks into `target` with
`pip install --no-deps --no-index --target` (nothing resolved, nothing downloaded; the project itself is used from
the working tree through PYTHONPATH), and the check puts `target` on the path of its processes.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / ".gpu-wheels"
MACHINE_HOLDS = ("torch", "timm", "onnx", "onnxruntime", "transformers", "pytest")
# Those whose requirements can be counted on there; timm's and transformers' vary with their releases (pydantic,
# httpx and anyio come with some), so what they may bring is carried too and installed only where it is missing.
RELIED_ON = ("torch", "onnx", "onnxruntime", "pytest")
# The gateway (`vit-serve serve`, the tests' gateway; its app imports the gRPC service and so tritonclient),
# the tests' HTTP client, and vit-export's ONNX exporter.
CARRIED_ROOTS = ("fastapi", "uvicorn", "pydantic-settings", "python-multipart", "prometheus-client", "httpx",
                 "tritonclient[grpc]", "onnxscript")
CARRY_PYTHONS = ("3.11", "3.12", "3.13")
CARRY_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
CARRY_LIMIT_BYTES = 64 * 2**20  # what may travel with the working tree
CARRY_BUDGET_BYTES = 40 * 2**20  # what the wheels may take of it: the working tree travels too
# module -> distribution of what never travels: a stage that needs one is "not available here".
NOT_CARRIED = {"tensorrt": "tensorrt (its wheels are over a gigabyte)",
               "skimage": "scikit-image (it needs SciPy: too large to carry)",
               "matplotlib": "matplotlib (too large to carry with its compiled requirements)"}
PHOTOS = "photos"


def canonical(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: Iterable[str], find: Callable[[str], md.Distribution] = md.distribution) -> dict[str, str]:
    """{canonical name: installed version} of `roots` (requirement strings, extras allowed) and everything they
    require here, transitively (markers evaluated for this Python); a distribution not installed is left out."""
    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    extras_of: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        new_extras = set(req.extras) - extras_of.get(name, set())
        if name in seen and not new_extras:
            continue
        try:
            dist = find(req.name)
        except md.PackageNotFoundError:
            continue
        extras_of.setdefault(name, set()).update(req.extras)
        seen[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *extras_of[name])):
                todo.append(sub)
    return seen


def carry_list() -> dict[str, str]:
    """{name: version} to carry: what the check needs beyond what the GPU machine's Python surely holds."""
    held = closure(RELIED_ON)
    return {n: v for n, v in sorted(closure(CARRIED_ROOTS).items()) if n not in held}


def fetch(dest: Path = DEFAULT_DIR, pythons: Iterable[str] = CARRY_PYTHONS) -> int:
    """Download the carried wheels into `dest` (pure ones once, compiled ones per Python) and save the corpus
    photos; SystemExit when the folder grows past CARRY_BUDGET_BYTES. Returns its size in bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={v}" for n, v in carry_list().items()]
    platforms = [a for p in CARRY_PLATFORMS for a in ("--platform", p)]
    for py in pythons:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", py, "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                       check=True)
    save_photos(dest / PHOTOS)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if size > CARRY_BUDGET_BYTES:
        raise SystemExit(f"{dest} holds {size / 2**20:.1f} MiB, over the {CARRY_BUDGET_BYTES / 2**20:.0f} MiB "
                         f"the wheels may take of the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB that travel")
    return size


def save_photos(folder: Path) -> list[Path]:
    """The upload corpus's photos (scikit-image's and matplotlib's, as `upload_corpus.photos` loads them) as
    lossless PNG files, so that the corpus is built there, byte for byte, without those packages."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import upload_corpus

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (name, img) in enumerate(upload_corpus.photos().items()):  # numbered: the mosaic tiles them in order
        path = folder / f"{i}-{name}.png"
        img.save(path, optimize=True)
        out.append(path)
    return out


def load_photos(folder: Path) -> dict:
    """The photos `save_photos` wrote, as `upload_corpus.photos()` returns them ({name: RGB PIL image})."""
    from PIL import Image

    out = {}
    for path in sorted(folder.glob("*-*.png"), key=lambda p: int(p.stem.split("-", 1)[0])):
        with Image.open(path) as img:
            out[path.stem.split("-", 1)[1]] = img.convert("RGB")
    return out


def install(folder: Path, target: Path, python: str = sys.executable) -> str:
    """Install into `target` the carried wheels of `folder` whose distribution this Python lacks (only those
    that fit this interpreter and platform); one line saying what was done. Never reaches a network."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return (f"carried wheels: none in {folder} (fill it where PyPI is reachable: python "
                f"benchmarks/gpu_wheels.py, and carry it)")
    tags = set(sys_tags())
    by_name: dict[str, list[tuple[Path, frozenset]]] = {}
    for w in wheels:
        name, _, _, wtags = parse_wheel_filename(w.name)
        by_name.setdefault(canonical(name), []).append((w, wtags))
    here, chosen, unfit = [], [], []
    for name, files in sorted(by_name.items()):
        try:
            md.distribution(name)
            here.append(name)
            continue
        except md.PackageNotFoundError:
            pass
        fit = [w for w, wtags in files if wtags & tags]
        (chosen.append(fit[0]) if fit else unfit.append(name))
    line = f"carried wheels: {len(here)} already here"
    if unfit:
        line += f"; none for this Python ({sys.version_info.major}.{sys.version_info.minor}): {', '.join(unfit)}"
    if not chosen:
        return line + "; nothing to install"
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check",
                        "--no-warn-script-location", "--target", str(target), *map(str, chosen)],
                       capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    names = ", ".join(parse_wheel_filename(w.name)[0] for w in chosen)
    if r.returncode != 0:
        tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-2:])[-300:]
        return line + f"; pip could not install {names}: exit {r.returncode}: {tail}"
    return line + f"; installed {len(chosen)} into {target}: {names}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", nargs="?", type=Path, default=DEFAULT_DIR, help="the folder (default ./.gpu-wheels)")
    ap.add_argument("--pythons", default=",".join(CARRY_PYTHONS),
                    help="the Pythons to carry compiled wheels for (default %(default)s)")
    ap.add_argument("--list", action="store_true", help="print what would be carried, and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, version in carry_list().items():
            print(f"{name}=={version}")
        return 0
    size = fetch(args.dest, args.pythons.split(","))
    print(f"{args.dest}: {len(list(args.dest.glob('*.whl')))} wheels and the corpus photos, {size / 2**20:.1f} MiB "
          f"(at most {CARRY_LIMIT_BYTES / 2**20:.0f} MiB travel with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
