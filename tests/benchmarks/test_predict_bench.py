"""benchmarks/predict.py's pure pieces: the checks say what the README says (predict >= 1.2x the gateway, Ray >= 0.7x
the local engine, and the Ray check only when it ran), and the folder it builds holds unique copies of the photos."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "predict.py"


def _script():
    spec = importlib.util.spec_from_file_location("predict_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_checks_compare_with_the_targets():
    checks = _script().checks
    assert [ok for *_, ok in checks(30.0, 25.0, 20.0, 28.0)] == [True, True]  # 1.2x, 0.71x
    assert [ok for *_, ok in checks(29.0, 25.0, 19.0, 28.0)] == [False, False]  # 1.16x, 0.68x
    assert len(checks(30.0, 25.0, None, None)) == 1


def test_the_folder_holds_unique_jpegs_of_the_same_pixels(tmp_path):
    """Reference: hashlib's sha256 and Pillow's decode of the original bytes."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "JPEG")
    _script().make_folder(tmp_path, [buf.getvalue()], 5)
    files = sorted(tmp_path.glob("*.jpg"))
    assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files}) == 5
    with Image.open(buf) as want:
        for f in files:
            with Image.open(f) as got:
                assert np.array_equal(np.asarray(got), np.asarray(want))
