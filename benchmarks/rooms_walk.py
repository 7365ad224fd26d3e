"""One upload, one `vit-export` and one `predict` run walked through the rooms of the code: which of our modules
each enters, in order, how often the call path crosses from one module to another, and how often it enters the
ONNX exporter. `python benchmarks/rooms_walk.py [ROOT]` (ROOT: a checkout, default this one; e.g. a `git worktree`
of an older commit, to compare before and after). A tiny random ViT (Ti/16, 2 blocks, 32x32); nothing downloaded."""

from __future__ import annotations

import io
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from code_shape import importable  # noqa: E402


@dataclass
class Walk:
    """What a traced call did: our modules in order of first entry, calls between two of our modules."""

    order: list[str] = field(default_factory=list)
    crossings: int = 0
    entries: dict[str, int] = field(default_factory=dict)
    armed: bool = True  # counting; off while a server starts and warms up


def module_of(filename: str, roots: dict[Path, str]) -> str | None:
    path = Path(filename)
    for root, package in roots.items():
        if path.is_relative_to(root):
            rel = path.relative_to(root).with_suffix("")
            parts = [package, *rel.parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def walk(fn: Callable[[Walk], object], site: Path, armed: bool = True) -> Walk:
    """Run `fn` with a profiler on every thread, counting calls from one of our modules into another (those
    imported from `site`, the folder `code_shape.importable` made)."""
    roots = {site / "vit_serve": "vit_serve", site / "vit_export": "vit_export"}
    out, cache = Walk(armed=armed), {}

    def ours(code) -> str | None:
        if code.co_filename not in cache:
            cache[code.co_filename] = module_of(code.co_filename, roots)
        return cache[code.co_filename]

    def profile(frame, event, _arg):
        if event != "call" or not out.armed:
            return
        callee = ours(frame.f_code)
        if callee is None:
            return
        caller, back = None, frame.f_back
        while back is not None and caller is None:  # the nearest of our frames below it
            caller, back = ours(back.f_code), back.f_back
        if callee not in out.entries:
            out.order.append(callee)
            out.entries[callee] = 0
        if caller != callee:
            out.crossings += 1
            out.entries[callee] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn(out)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return out


def tiny_checkpoint(folder: Path) -> Path:
    import vit_serve

    model = vit_serve.create_model("Ti/16", num_classes=3, depth=2, img_size=32)
    model.labels = ["zero", "one", "two"]
    return vit_serve.save(model, folder / "tiny.safetensors") or folder / "tiny.safetensors"


def photo_jpeg() -> bytes:
    from PIL import Image
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def walks(site: Path) -> dict[str, Walk]:
    import vit_export
    from fastapi.testclient import TestClient

    from vit_serve.predict import PredictOptions, predict
    from vit_serve.serve import ServeSettings, create_app
    from vit_serve.serve.settings import ModelDefaults

    tmp = Path(tempfile.mkdtemp(prefix="rooms_"))
    ckpt = tiny_checkpoint(tmp)
    jpeg = photo_jpeg()
    out: dict[str, Walk] = {}
    def upload(w: Walk) -> None:  # the server's threads start under the profiler; the second request counts
        settings = ServeSettings(model=str(ckpt), model_defaults=ModelDefaults(max_delay_ms=0))
        with TestClient(create_app(settings)) as client:
            for armed in (False, True):
                w.armed = armed
                assert client.post("/classify", files={"file": ("a.jpg", jpeg, "image/jpeg")}).status_code == 200
            w.armed = False

    out["POST /classify (torch)"] = walk(upload, site, armed=False)
    out["vit_export.export (ONNX)"] = walk(
        lambda _: vit_export.export(ckpt, vit_export.ExportOptions(out=tmp / "export", name="tiny")), site)
    (tmp / "photos").mkdir()
    for i in range(4):
        (tmp / "photos" / f"{i}.jpg").write_bytes(jpeg)
    out["predict (onnxruntime, 4 files)"] = walk(lambda _: predict(PredictOptions(
        model=str(tmp / "export" / "tiny.onnx"), src=str(tmp / "photos"), out=str(tmp / "preds.jsonl"), quiet=True,
        workers=1)), site)
    return out


def main(argv: list[str] | None = None) -> None:
    root = Path((argv or sys.argv[1:] or [str(HERE.parent)])[0]).resolve()
    site = importable(root)
    print(f"# rooms walked, {root}\n")
    for name, w in walks(site).items():
        onnx = w.entries.get("vit_export.onnx_export", 0)
        print(f"## {name}\n{len(w.order)} modules, {w.crossings} calls from one module into another, "
              f"vit_export.onnx_export entered {onnx} times\n")
        print(" -> ".join(m.removeprefix("vit_serve.") for m in w.order) + "\n")


if __name__ == "__main__":
    main()
