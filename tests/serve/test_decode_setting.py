"""`decode` in the gateway: fast by default; `--decode` / VIT_SERVE_DECODE exact or fast over the model's
contract, or contract (the model's own field). The answer of POST /classify is checked against the library
(`vit_serve.preprocess` on that path + the PyTorch model), and GET /v2/models/{name} shows the contract the
server decodes with."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for

from vit_serve.preprocess import preprocess


@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    """A 1200 x 800 photo: large enough that the fast path decodes it at 1/8 scale for the 32 x 48 model."""
    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.coffee()).resize((1200, 800), Image.Resampling.BICUBIC).save(buf, "JPEG",
                                                                                            quality=90)
    return buf.getvalue()


def _scores(model, data: bytes, decode: str) -> np.ndarray:
    with torch.no_grad():
        logits = model(preprocess(data, model.preprocess_cfg.with_decode(decode))[None])[0].double()
    return torch.softmax(logits, -1).numpy()


def _served(settings, data: bytes) -> tuple[np.ndarray, dict]:
    async def scenario():
        async with serving(settings) as (client, _):
            r = await client.post("/classify?top_k=10", content=data, headers={"Content-Type": "image/jpeg"})
            meta = await client.get("/v2/models/tiny")
            return r, meta

    r, meta = run(scenario())
    assert r.status_code == 200, r.text
    scores = np.zeros(10)
    for p in r.json()["predictions"]:
        scores[p["index"]] = p["score"]
    return scores, meta.json()["parameters"]["preprocess"]


@pytest.mark.parametrize(("override", "want"), [(None, "fast"), ("exact", "exact"), ("fast", "fast"),
                                              ("contract", "exact")])
def test_classify_decodes_on_the_chosen_path(tiny_ckpt, tiny_model, big_jpeg, override, want, one_thread):
    assert tiny_model.preprocess_cfg.decode == "exact"  # the checkpoint's contract
    other = "fast" if want == "exact" else "exact"
    ref, ref_other = _scores(tiny_model, big_jpeg, want), _scores(tiny_model, big_jpeg, other)
    assert np.abs(ref - ref_other).max() > 1e-4  # the two paths are told apart by this check
    from vit_serve.serve.settings import ServeSettings

    chosen = ServeSettings.model_fields["decode"].default if override is None else override
    scores, contract = _served(settings_for(tiny_ckpt, decode=chosen), big_jpeg)
    assert contract["decode"] == want
    assert np.abs(scores - ref).max() <= 1e-5


def test_decode_setting_from_the_environment(monkeypatch, tiny_ckpt):
    from pydantic import ValidationError

    from vit_serve.serve.settings import ServeSettings

    assert ServeSettings(model=str(tiny_ckpt)).decode == "fast"
    monkeypatch.setenv("VIT_SERVE_DECODE", "contract")
    assert ServeSettings(model=str(tiny_ckpt)).decode is None  # None: the model's contract
    monkeypatch.setenv("VIT_SERVE_DECODE", "exact")
    assert ServeSettings(model=str(tiny_ckpt)).decode == "exact"
    monkeypatch.setenv("VIT_SERVE_DECODE", "turbo")
    with pytest.raises(ValidationError, match="decode"):
        ServeSettings(model=str(tiny_ckpt))


def test_cli_decode_flag(capsys, monkeypatch, tiny_ckpt):
    import vit_serve.cli as cli

    seen = {}
    monkeypatch.setattr("vit_serve.serve.app.run", lambda settings: seen.__setitem__("settings", settings))
    assert cli.main(["serve", str(tiny_ckpt), "--decode", "exact"]) == 0
    assert seen["settings"].decode == "exact"
    assert cli.main(["serve", str(tiny_ckpt)]) == 0
    assert seen["settings"].decode == "fast"
    assert cli.main(["serve", str(tiny_ckpt), "--decode", "contract"]) == 0
    assert seen["settings"].decode is None
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", str(tiny_ckpt), "--decode", "turbo"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--decode" in err and "Traceback" not in err
