"""A RoPE export through the gateway: a tiny DINOv3 (timm's `Eva`, random weights, tests/rope_models.py) exported
once with `--res dynamic`, its contract set to 112 x 80 (the model was built at 64 x 64), served by the
onnxruntime backend. POST /classify of a real photo gives the scores of timm's own model on the pixels
`vit_serve.preprocess` makes of the upload (softmax of its logits) within 1e-4. The sidecar carries no RoPE
settings: the graph computes its rotary tables from the input's shape, so the runtime needs none."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for

from tests.rope_models import ours_rope, timm_rope
from vit_serve.preprocess import PreprocessConfig, preprocess

pytest.importorskip("timm")
pytest.importorskip("onnxscript")

SIZE = (112, 80)  # 7 x 5 patches; the export is traced at 4 x 4


def test_classify_on_a_dynamic_dinov3_export_equals_timm(tmp_path, photos):
    import vit_export

    ref = timm_rope("dinov3")
    model = ours_rope("dinov3", ref)
    model.labels = [f"label{i}" for i in range(model.cfg.num_classes)]
    model.preprocess_cfg = PreprocessConfig(input_size=SIZE, crop_pct=1.0)
    # The Python API's export of the model itself: traced at its own 64 x 64, the sidecar's contract 112 x 80 (a
    # saved checkpoint's contract follows its resolution).
    result = vit_export.export(model, vit_export.ExportOptions(out=tmp_path / "out", res="dynamic", name="dinov3"))
    assert result.ok and tuple(model.cfg.img_size) == (64, 64)

    async def go():
        async with serving(settings_for(result.onnx)) as (client, _):
            answers = {name: await client.post("/classify?top_k=10", files={"file": (name, data)})
                       for name, data in photos.items()}
            return answers, await client.get("/v2/models/dinov3")

    answers, meta = run(go())
    assert meta.status_code == 200, meta.text
    for name, r in answers.items():
        assert r.status_code == 200 and r.json()["resolution"] == list(SIZE), r.text
        x = preprocess(photos[name], model.preprocess_cfg)[None]
        assert tuple(x.shape[-2:]) == SIZE
        with torch.no_grad():
            want = ref(x)[0].softmax(-1).numpy().astype(np.float64)
        got = {p["index"]: p["score"] for p in r.json()["predictions"]}
        err = max(abs(s - want[i]) for i, s in got.items())
        print(f"dinov3 {SIZE[0]}x{SIZE[1]} {name}: |d score| {err:.1e} over {len(got)} classes")
        assert len(got) == len(want) and err <= 1e-4
