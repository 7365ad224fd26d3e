"""An exported graph is loaded only when its bytes are the ones its manifest records (`file_sha256`).

Two exports of a tiny ViT with different weights (`vit_export.export`, the real exporter): a graph beside the other
export's manifest is refused by the onnxruntime backend in one line. Under a real uvicorn with `--model-control
poll`, version 2 dropped into the repository with its new manifest but the old graph (a copy not yet complete) is
refused with that reason in GET /models while version 1 keeps answering; once its graph arrives, version 2 loads
and answers with its own weights.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_helpers import live_app, settings_for

LABELS = [f"class {i}" for i in range(10)]
JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, export_tiny) -> tuple[Path, Path]:
    """tiny.onnx + tiny.json of two exports (seeds 1 and 2; same architecture, resolution and labels)."""
    out = []
    for seed in (1, 2):
        d = tmp_path_factory.mktemp(f"export{seed}")
        result, _ = export_tiny(d, 32, seed, LABELS, out=d / "out", name="tiny")
        assert result.ok
        out.append(result.onnx)
    return out[0], out[1]


def _version(folder: Path, graph: Path, manifest: Path) -> Path:
    """A version folder written elsewhere and renamed into place (a poll sees all of it or none of it)."""
    staged = folder.parent / f".{folder.name}.staged"
    staged.mkdir(parents=True)
    shutil.copy(graph, staged / "tiny.onnx")
    shutil.copy(manifest, staged / "tiny.json")
    staged.rename(folder)
    return folder


def test_a_graph_that_is_not_its_manifests_is_refused(exports, tmp_path):
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

    first, second = exports
    mixed = tmp_path / "mixed"
    _version(mixed, first, second.with_suffix(".json"))
    with pytest.raises(ValueError, match=r"tiny\.onnx does not match its manifest tiny\.json \(sha256") as e:
        OnnxRuntimeBackend(mixed / "tiny.onnx", threads=1)
    assert "\n" not in str(e.value)
    assert OnnxRuntimeBackend(second, threads=1).classify(np.zeros((1, 3, 32, 32), np.float32)).shape == (1, 10)


def _wait(what: str, ready, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def test_a_polled_repository_keeps_serving_while_a_new_graph_and_its_manifest_disagree(exports, tmp_path, photos):
    first, second = exports
    repo = tmp_path / "repo"
    _version(repo / "vit" / "1", first, first.with_suffix(".json"))
    settings = settings_for(repo, model_control="poll", repository_poll_s=0.2, default_model="vit")
    image = photos["coffee.jpg"]
    with live_app(settings) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        def classify() -> dict:
            r = client.post("/classify?top_k=10", content=image, headers=JPEG)
            assert r.status_code == 200, r.text
            return {k: r.json()[k] for k in ("version", "predictions")}

        def version_2() -> dict | None:
            rows = [v for m in client.get("/models").json()["models"] if m["name"] == "vit"
                    for v in m["versions"] if v["version"] == 2]
            return rows[0] if rows else None

        v1 = classify()
        assert v1["version"] == "1"
        # version 2's manifest has arrived, its graph not yet: the old export's bytes are still there
        _version(repo / "vit" / "2", first, second.with_suffix(".json"))
        refused = _wait("version 2 shown as refused", lambda: (v := version_2()) and v["state"] == "UNAVAILABLE"
                        and v["reason"] and v)
        assert "does not match its manifest" in refused["reason"], refused
        for _ in range(5):  # version 1 serves on, unchanged
            assert classify() == v1
        # the copy completes: version 2's own graph, written and renamed over the old bytes
        staged = repo / "vit" / ".tiny.onnx.staged"
        shutil.copy(second, staged)
        os.replace(staged, repo / "vit" / "2" / "tiny.onnx")
        v2 = _wait("version 2 serving", lambda: (a := classify())["version"] == "2" and a)
        assert version_2()["state"] == "READY"
        assert v2["predictions"] != v1["predictions"]  # its own weights
