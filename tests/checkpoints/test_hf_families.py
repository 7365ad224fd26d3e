"""Hugging Face transformers DINOv2 (with registers), CLIP and SigLIP folders -> ours.

Reference: the installed transformers' `Dinov2Model`, `Dinov2WithRegistersModel`, `CLIPVisionModel`,
`CLIPVisionModelWithProjection`, `CLIPModel`, `SiglipVisionModel`, `SiglipModel`, each built from a tiny config
with random non-trivial weights (conftest.randomize_: LayerScale gammas, biases, tokens all random) and written
with `save_pretrained`; nothing downloaded. The embedding compared is each family's own: `pooler_output`, or
`image_embeds` / `get_image_features` for CLIP with its projection; other sizes against HF's own resampling
(`interpolate_pos_encoding=True`; DINOv2 always interpolates).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vit_serve.checkpoints import load  # noqa: E402
from vit_serve.checkpoints.converted import CheckpointError  # noqa: E402
from vit_serve.checkpoints.hf_clip import split_towers  # noqa: E402
from vit_serve.checkpoints.hf_models import convert_hf  # noqa: E402

T = transformers
_V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
_DINO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14)
_TOWER = dict(_V, image_size=28, patch_size=7)
# kind -> (build the HF model, native size)
BUILDS = {
    "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(**_DINO, layerscale_value=0.5)), 56),
    "dinov2_reg": (lambda: T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(**_DINO, num_register_tokens=2)),
                   56),
    "clip_vision": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**_TOWER)), 28),
    "clip_vision_proj": (lambda: T.CLIPVisionModelWithProjection(T.CLIPVisionConfig(**_TOWER, projection_dim=16)),
                         28),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(text_config=_V, vision_config=_TOWER, projection_dim=16)), 28),
    "siglip_vision": (lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**_TOWER)), 28),
    "siglip": (lambda: T.SiglipModel(T.SiglipConfig(text_config=dict(_V, bos_token_id=1, eos_token_id=2),
                                                    vision_config=_TOWER)), 28),
}
# kind -> (family, resample_mode, gelu, layer_norm_eps, prefix tokens, embedding width)
EXPECTED = {
    "dinov2": ("dinov2", "hf", "exact", 1e-6, 1, 32),
    "dinov2_reg": ("dinov2", "timm", "exact", 1e-6, 3, 32),
    "clip_vision": ("clip", "hf", "quick", 1e-5, 1, 32),
    "clip_vision_proj": ("clip", "hf", "quick", 1e-5, 1, 16),
    "clip": ("clip", "hf", "quick", 1e-5, 1, 16),
    "siglip_vision": ("siglip", "hf", "tanh", 1e-6, 0, 32),
    "siglip": ("siglip", "hf", "tanh", 1e-6, 0, 32),
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("vit-serve")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "vit_serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def hf_embedding(kind: str, model: torch.nn.Module, x: torch.Tensor, native: int) -> torch.Tensor:
    """The family's own image embedding from the HF model, resampling its own way off the native size."""
    kw = {} if kind.startswith("dinov2") else {"interpolate_pos_encoding": tuple(x.shape[-2:]) != (native,) * 2}
    if kind in ("clip", "siglip"):
        out = model.get_image_features(pixel_values=x, **kw)
        return out if isinstance(out, torch.Tensor) else out.pooler_output
    out = model(pixel_values=x, **kw)
    return out.image_embeds if kind == "clip_vision_proj" else out.pooler_output


@pytest.fixture(scope="module")
def folders(tmp_path_factory, randomize) -> dict[str, tuple[Path, torch.nn.Module, int]]:
    out = {}
    for i, (kind, (build, native)) in enumerate(BUILDS.items()):
        model = randomize(build(), seed=10 + i)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        out[kind] = (folder, model, native)
    return out


@pytest.mark.parametrize("kind", list(BUILDS))
def test_embedding_equals_hf_at_native_and_other_sizes(folders, kind):
    folder, ref, native = folders[kind]
    ours = load(folder)
    family, mode, gelu, eps, prefix, width = EXPECTED[kind]
    c = ours.cfg
    assert (c.family, c.resample_mode, c.gelu, c.layer_norm_eps, c.num_prefix_tokens, c.embed_dim_out) == (
        family, mode, gelu, eps, prefix, width)
    assert c.num_classes == 0 and ours.labels is None
    g = torch.Generator().manual_seed(1)
    for size in ((native, native), (42, 42), (42, 70)):
        x = torch.randn(2, 3, *size, generator=g)
        with torch.no_grad():
            want = hf_embedding(kind, ref, x, native)
            got = ours.forward_head(ours.forward_features(x), pre_logits=True)
            _, emb = ours.forward_embedding(x)
            explicit = ours(x, return_attention=True)[0]  # no head: the logits are the embedding
        err = max((t - want).abs().max().item() for t in (got, emb, explicit))
        print(f"HF {type(ref).__name__} {size[0]}x{size[1]}: |emb| max {want.abs().max():.2f}, max |diff| {err:.2e}")
        assert want.abs().max() > 0.5 and err <= 1e-5


@pytest.mark.parametrize("kind", ["dinov2_reg", "siglip_vision", "clip"])
def test_img_size_override_resamples_at_conversion(folders, kind):
    folder, ref, native = folders[kind]
    ours = load(folder, img_size=(42, 42))
    assert ours.cfg.img_size == (42, 42) and ours.preprocess_cfg.input_size == (42, 42)
    x = torch.randn(1, 3, 42, 42, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (ours.forward_head(ours.forward_features(x), pre_logits=True)
               - hf_embedding(kind, ref, x, native)).abs().max().item()
    assert err <= 1e-5


def test_register_class_position_folded_into_class_token(folders):
    folder, ref, _ = folders["dinov2_reg"]
    sd = load(folder).state_dict()
    emb = ref.embeddings
    torch.testing.assert_close(sd["cls_token"], emb.cls_token + emb.position_embeddings[:, :1], rtol=0, atol=0)
    assert sd["pos_embed"].shape == (1, 16, 32) and sd["reg_token"].shape == (1, 2, 32)
    assert not any("mask_token" in k for k in sd)


def test_in_memory_names_convert_identically(folders):
    folder, ref, _ = folders["dinov2"]  # transformers 5 in memory: attention.q_proj / o_proj; on disk: legacy
    on_disk = load(folder).state_dict()
    in_memory = convert_hf(ref.config.to_dict(), ref.state_dict()).state_dict
    assert on_disk.keys() == in_memory.keys()
    assert all(torch.equal(on_disk[k], in_memory[k]) for k in on_disk)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_text_tower_keys_are_set_aside(folders, kind):
    _, ref, _ = folders[kind]
    vision, text = split_towers(ref.state_dict())
    assert text and all(k.startswith("text_model.") or k in ("text_projection.weight", "logit_scale", "logit_bias")
                        for k in text)
    assert not any(k.startswith("text") for k in vision)
    conv = convert_hf(ref.config.to_dict(), ref.state_dict())  # the text keys neither converted nor refused
    assert not any("text" in k or "logit" in k for k in conv.state_dict)


def test_preprocessing_from_processor_config_and_defaults(folders, tmp_path):
    folder, _, _ = folders["clip_vision_proj"]
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    # old CLIP style: integer size = shortest edge (CLIPImageProcessor's default_to_square=False), int crop
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": 32, "crop_size": 28, "do_center_crop": True, "resample": 3,
         "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    p = load(tmp_path).preprocess_cfg
    assert (p.input_size, p.interpolation, p.crop_mode, p.mean[0]) == ((28, 28), "bicubic", "center", 0.48145466)
    assert abs(p.crop_pct - 28 / 32) < 1e-12
    d = load(folders["dinov2"][0]).preprocess_cfg  # no file: BitImageProcessor defaults at the model's size
    assert (d.input_size, d.interpolation, d.crop_mode, d.crop_pct, d.std[0]) == (
        (56, 56), "bicubic", "center", 1.0, 0.26862954)
    s = load(folders["siglip"][0]).preprocess_cfg  # SiglipImageProcessor: squash, mean = std = 0.5
    assert (s.input_size, s.interpolation, s.crop_mode, s.mean, s.std) == (
        (28, 28), "bicubic", "squash", (0.5,) * 3, (0.5,) * 3)


def _refusal(folder: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load(folder)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refusals_name_what_is_missing(tmp_path, randomize):
    cases = {
        "swiglu": (T.Dinov2Model(T.Dinov2Config(**_DINO, use_swiglu_ffn=True)), "use_swiglu_ffn=true: the SwiGLU"),
        "beit": (T.BeitModel(T.BeitConfig(**_V, image_size=28, patch_size=7, use_relative_position_bias=True)),
                 "model_type='beit' is not supported: it needs relative position bias"),
        "dino_cls": (T.Dinov2ForImageClassification(T.Dinov2Config(**_DINO, num_labels=3)),
                     "Dinov2ForImageClassification is not supported"),
        "no_head": (T.SiglipVisionModel(T.SiglipVisionConfig(**_TOWER, vision_use_head=False)),
                    "vision_use_head=false"),
    }
    for name, (model, message) in cases.items():
        model.save_pretrained(tmp_path / name)
        assert message in _refusal(tmp_path / name), name


def test_cli_convert_clip_with_projection(folders, tmp_path):
    folder, ref, native = folders["clip_vision_proj"]
    dst = tmp_path / "clip.safetensors"
    r = run_cli("convert", str(folder), str(dst))
    assert r.returncode == 0, r.stderr
    assert "0 classes" in r.stdout and "gelu=quick" in r.stdout and "ln_eps=1e-05" in r.stdout
    ours = load(dst)
    x = torch.randn(2, 3, native, native, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = (ours.forward_embedding(x)[1] - hf_embedding("clip_vision_proj", ref, x, native)).abs().max().item()
    assert ours.cfg.proj_dim == 16 and err <= 1e-5


def test_cli_refuses_swiglu_dinov2(tmp_path):
    src = tmp_path / "dinov2_swiglu"
    T.Dinov2Model(T.Dinov2Config(**_DINO, use_swiglu_ffn=True)).save_pretrained(src)
    dst = tmp_path / "out.safetensors"
    r = run_cli("convert", str(src), str(dst))
    assert r.returncode == 2 and "use_swiglu_ffn" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not dst.exists()
