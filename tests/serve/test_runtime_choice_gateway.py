"""The gateway's load-time runtime choice (`choose_runtime`, `vit_serve.runtime.runtime_choice`) with two real
runtimes, PyTorch eager and onnxruntime (and OpenVINO where installed), on a random-weight checkpoint (no mocks):
the version serves the fastest runtime that passes in the table it measured, GET /models shows that table, and a
model's config.toml pins one."""

from __future__ import annotations

import shutil

import pytest
import torch
from gateway_helpers import LABELS, run, serving, settings_for

import vit_serve
from vit_serve.preprocess import preprocess

RES = (32, 32)
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("choice") / "chosen.safetensors", RES, 4, LABELS)


def _models_and_answer(settings, photos):
    name, data = next(iter(photos.items()))

    async def go():
        async with serving(settings) as (client, _):
            models = (await client.get("/models")).json()
            return models, await client.post("/classify", files={"file": (name, data, "image/jpeg")})

    return run(go()), data


def test_the_fastest_passing_runtime_serves_and_models_shows_the_table(ckpt, photos):
    settings = settings_for(ckpt, choose_runtime=True, choose_runtime_budget_s=2.0, max_batch=4)
    (models, r), data = _models_and_answer(settings, photos)
    choice = models["models"][0]["versions"][0]["runtime_choice"]
    assert choice["pinned"] is False and choice["threads"] == 1 and choice["seconds"] > 0
    rows = choice["rows"]
    assert [(row["runtime"], row["precision"]) for row in rows[:2]] == [("eager", "fp32"), ("onnxruntime", "fp32")]
    assert [row["runtime"] for row in rows[2:]] in ([], ["openvino"])  # in its native precision, if installed
    for row in rows:
        assert set(row["images_per_s"]) == {"1", "4"}
    for row in rows[:2]:
        assert row["refused"] is None and row["agreement"] == 1.0 and row["cosine"] > 0.9999

    def score(row):
        rates = list(row["images_per_s"].values())
        return (rates[0] * rates[1]) ** 0.5

    fastest = max((row for row in rows if row["refused"] is None), key=score)
    assert choice["chosen"] == f"{fastest['runtime']}:{fastest['precision']}"
    assert r.status_code == 200, r.text
    ref = vit_serve.load(ckpt).eval()
    with torch.no_grad():
        top = int(ref(preprocess(data, ref.preprocess_cfg)[None]).argmax())
    assert r.json()["predictions"][0]["label"] == LABELS[top]


def test_a_model_config_pins_a_runtime_and_the_default_chooses_none(ckpt, photos, tmp_path):
    folder = tmp_path / "repo" / "pinned"
    (folder / "1").mkdir(parents=True)
    shutil.copy(ckpt, folder / "1" / "pinned.safetensors")
    (folder / "config.toml").write_text('pin_runtime = "onnxruntime"\n')
    (models, r), _ = _models_and_answer(settings_for(tmp_path / "repo"), photos)
    choice = models["models"][0]["versions"][0]["runtime_choice"]
    assert choice["pinned"] is True and choice["chosen"] == "onnxruntime:fp32"
    assert all(row["images_per_s"] == {} for row in choice["rows"])
    assert r.status_code == 200, r.text
    (models, _), _ = _models_and_answer(settings_for(ckpt), photos)  # tests run with VIT_SERVE_CHOOSE_RUNTIME=false
    assert models["models"][0]["versions"][0]["runtime_choice"] is None
