"""POST /classify?labels=&abstain=true on the gateway (in-process, the torch backend, the text tower a converted
open_clip checkpoint holds; random weights): the answer carries the best label's score, the threshold and its source,
and abstains exactly when the score is below it; without a reference a threshold must be given; abstain needs labels.
The reference's threshold: `monitor.abstain_threshold` on a reference built from outputs."""

from __future__ import annotations

import numpy as np
import pytest
from gateway_helpers import run, serving, settings_for
from safetensors.torch import save_file

from vit_serve import monitor
from vit_serve.checkpoints import convert

open_clip = pytest.importorskip("open_clip")
from tests.text import tiny_clip  # noqa: E402

JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("abstain")
    tiny_clip.register(folder)
    save_file(tiny_clip.state_dict(tiny_clip.randomized("tiny-clip", seed=3)), folder / "oc.safetensors")
    convert(folder / "oc.safetensors", folder / "zs.safetensors", arch="open_clip:tiny-clip", zero_shot=["a", "b"])
    return folder / "zs.safetensors"


def test_abstains_below_the_threshold_it_reports(ckpt, photos):
    cat = photos["chelsea.jpg"]
    labels = "tabby cat,espresso,astronaut"

    async def scenario():
        async with serving(settings_for(ckpt)) as (client, _):
            plain = await client.post(f"/classify?labels={labels}", content=cat, headers=JPEG)
            asked = [await client.post(f"/classify?labels={labels}&abstain=true&threshold={t}", content=cat,
                                       headers=JPEG) for t in (0.0, 1.0)]
            refused = [await client.post(f"/classify?{q}", content=cat, headers=JPEG)
                       for q in (f"labels={labels}&abstain=true", "abstain=true&threshold=0.5")]
            return plain, asked, refused

    plain, (low, high), (no_reference, no_labels) = run(scenario())
    assert plain.status_code == low.status_code == high.status_code == 200, high.text
    best = plain.json()["predictions"][0]["score"]
    assert "abstention" not in plain.json()
    assert low.json()["abstention"] == {"abstained": False, "score": best, "threshold": 0.0, "source": "request"}
    assert high.json()["abstention"] == {"abstained": best < 1.0, "score": best, "threshold": 1.0,
                                         "source": "request"}
    assert best < 1.0 and high.json()["predictions"] == plain.json()["predictions"]
    assert no_reference.status_code == 400 and "give threshold=" in no_reference.json()["detail"]
    assert no_labels.status_code == 400 and "needs labels=" in no_labels.json()["detail"]


def test_the_reference_calibrates_the_served_threshold(tmp_path, photos):
    """convert --zero-shot --reference-images: without threshold=, the gateway compares with the reference's
    calibrated threshold and says so."""
    import io

    from PIL import Image

    import vit_serve

    folder = tmp_path / "ref"
    folder.mkdir()
    for i, data in enumerate(list(photos.values()) * 3):  # 9 images: crops of the photos
        im = Image.open(io.BytesIO(data)).convert("RGB")
        im.crop((i * 7, i * 5, im.width // 2 + i * 7, im.height // 2 + i * 5)).save(folder / f"{i}.png")
    tiny_clip.register(tmp_path)
    save_file(tiny_clip.state_dict(tiny_clip.randomized("tiny-clip", seed=3)), tmp_path / "oc.safetensors")
    dst = tmp_path / "zsref.safetensors"
    convert(tmp_path / "oc.safetensors", dst, arch="open_clip:tiny-clip", zero_shot=["a", "b"],
            reference_images=folder)
    want = monitor.abstain_threshold(vit_serve.load(dst).reference)

    async def scenario():
        async with serving(settings_for(dst)) as (client, _):
            return await client.post("/classify?labels=tabby cat,espresso&abstain=true",
                                     content=photos["chelsea.jpg"], headers=JPEG)

    r = run(scenario())
    assert r.status_code == 200, r.text
    a = r.json()["abstention"]
    assert a["source"] == "reference" and a["threshold"] == pytest.approx(want)
    assert a["score"] == r.json()["predictions"][0]["score"] and a["abstained"] == (a["score"] < want)


def test_reference_threshold_is_the_calibration_quantile():
    rng = np.random.default_rng(0)
    fit, calib = rng.normal(size=(200, 8)).astype(np.float32), rng.normal(size=(400, 8)).astype(np.float32)
    ref = monitor.build_reference(fit, 3 * fit[:, :4], calib, 3 * calib[:, :4], quantile=0.9)
    t = monitor.abstain_threshold(ref)
    confidences = monitor.softmax_confidence(3 * calib[:, :4])
    assert t == pytest.approx(float(np.quantile(confidences.astype(np.float64), 0.1)))
    assert np.mean(confidences < t) == pytest.approx(0.1, abs=0.01)
