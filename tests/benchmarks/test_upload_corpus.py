"""benchmarks/upload_corpus.py builds a corpus that two test workers may build into one cached folder at once
(tests/test_preprocess_fast.py and tests/serve/test_gpu_decode.py share pytest's cache): a build writes only
temporary files of its own, so that it never clobbers, or renames away, another build's file in progress."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "upload_corpus.py"


def _module():
    spec = importlib.util.spec_from_file_location("upload_corpus", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_build_leaves_other_builds_files_in_progress_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another worker's pid
    try:
        in_progress = {tmp_path / "thumbnail.jpg.tmp": b"half of another build's file",
                       tmp_path / f".thumbnail.jpg.{other.pid}.tmp": b"half of another build's file"}
        for path, data in in_progress.items():
            path.write_bytes(data)
        out = _module().build(tmp_path, ("thumbnail.jpg",))
    finally:
        other.kill()
        other.wait()
    assert {p: p.read_bytes() if p.exists() else None for p in in_progress} == in_progress
    with Image.open(out["thumbnail.jpg"]) as img:
        assert img.format == "JPEG" and img.size == (160, 120)
    assert sorted(p.name for p in tmp_path.iterdir() if p not in in_progress) == ["thumbnail.jpg"]
