"""The wheel `pip install .` builds (what the Dockerfile installs) holds every module and data file of the
source tree. Reference: pip and setuptools themselves build it; the test only lists the archive."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = {"vit_serve": "vit_serve", "export": "vit_export"}  # source folder -> installed package


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("vit_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = set()
    for folder, package in TREES.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".txt", ".html",
                                                                                       ".js", ".css"):
                want.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    missing = sorted(want - names)
    assert not missing, f"not in the wheel: {missing}"
