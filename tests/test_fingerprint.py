"""The embedding space's fingerprint (`vit_serve.fingerprint`) changes when, and only when, something that moves the
vectors changes: a table of changes made to a real model (its weights, its config, the settings it is served with),
each checked against the vectors themselves where the model can compute them; then the same through `vit-export`
(re-exports at the same settings share the manifest's fingerprint with the checkpoint served by the torch backend;
fp16 and ToMe exports do not) and the Triton repository's config parameter."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.fingerprint import EmbeddingSpace, weights_digest
from vit_serve.manifest import TokenMergingRecord, embedding_space_of, read_manifest

RES = 32


@pytest.fixture(scope="module")
def model(randomize) -> vit_serve.VisionTransformer:
    return randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=RES)).eval()


def _space(m, *, precision: str = "fp32", res: int = RES, normalized: bool = False, pre=None,
           tome: TokenMergingRecord | None = None) -> EmbeddingSpace:
    """What the torch backend and the exporter compute for `m` served at `res` (`embedding_space_of`)."""
    pre = (pre or m.preprocess_cfg or vit_serve.PreprocessConfig(input_size=(RES, RES))).with_size(res, res)
    return embedding_space_of(weights_digest(m.state_dict()), m.cfg, pre, precision, tome).normalized_as(normalized)


def _embed(m, res: int = RES, dtype=torch.float32) -> np.ndarray:
    x = torch.randn(2, 3, res, res, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return m.to(dtype).forward_embedding(x.to(dtype))[1].float().numpy()


def _copy(m):
    import copy

    return copy.deepcopy(m)


def _nudged(m):
    c = _copy(m)
    with torch.no_grad():
        c.blocks[0].mlp.fc1.weight[0, 0] += 1e-3
    return c


def _new_head(m):
    c = _copy(m)
    with torch.no_grad():
        c.head.weight.mul_(-2.0)
    return c


def _gap(m):
    c = _copy(m)
    c.cfg = dataclasses.replace(c.cfg, pool="gap")
    return c


def _resaved(m, folder: Path):
    vit_serve.save(m, folder / "some_other_name.safetensors", overwrite=True)
    return vit_serve.load(folder / "some_other_name.safetensors")


# (what changes, how it is made from the model -> (space, model whose vectors it describes or None), moves?)
Case = Callable[[vit_serve.VisionTransformer, Path], tuple[EmbeddingSpace, object]]
CASES: list[tuple[str, Case, bool]] = [
    ("the same weights saved under another file name and loaded", lambda m, f: (_space(r := _resaved(m, f)), r),
     False),
    ("a new classifier head (the embedding is what the head reads)", lambda m, f: (_space(h := _new_head(m)), h),
     False),
    ("ToMe with r = 0 in every layer (merges nothing)",
     lambda m, f: (_space(m, tome=TokenMergingRecord((0, 0))), None), False),
    ("one weight nudged by 1e-3", lambda m, f: (_space(n := _nudged(m)), n), True),
    ("pooling: the patch-token mean instead of the class token", lambda m, f: (_space(g := _gap(m)), g), True),
    ("resolution 64 instead of 32", lambda m, f: (_space(m, res=64), None), True),
    ("precision fp16", lambda m, f: (_space(m, precision="fp16"), None), True),
    ("ToMe r = 1", lambda m, f: (_space(m, tome=TokenMergingRecord((1, 1))), None), True),
    ("the decode path (fast or exact: the gateway's setting)",
     lambda m, f: (_space(m, pre=(m.preprocess_cfg or vit_serve.PreprocessConfig(input_size=(RES, RES))).with_decode(
         "fast")), None), False),
    ("L2-normalised vectors", lambda m, f: (_space(m, normalized=True), None), True),
    ("the first 64 dimensions (Matryoshka)", lambda m, f: (_space(m).truncated(64), None), True),
    ("truncated to the whole width", lambda m, f: (_space(m).truncated(m.num_features), None), False),
    ("another preprocessing contract (ImageNet mean / std)",
     lambda m, f: (_space(m, pre=vit_serve.PreprocessConfig(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))),
                   None), True),
]


@pytest.mark.parametrize(("what", "make", "moves"), CASES, ids=[c[0] for c in CASES])
def test_the_fingerprint_moves_with_the_vectors(model, tmp_path, what, make, moves):
    base = _space(model)
    space, changed = make(model, tmp_path)
    print(f"{what}: {space.fingerprint} vs {base.fingerprint}")
    assert (space.fingerprint != base.fingerprint) is moves
    if changed is not None:  # the model's own vectors agree with the table's row
        assert (not np.array_equal(_embed(changed), _embed(model))) is moves


def test_the_vectors_of_the_table_do_move(model):
    """The rows the table marks as moving, on the model itself: fp16, ToMe r = 1 and another resolution each give
    other vectors (so that a fingerprint equal across them would let a client mix spaces)."""
    ref = _embed(_copy(model))
    assert not np.allclose(_embed(_copy(model), dtype=torch.float16), ref, atol=1e-6)
    merged = _copy(model)
    merged.set_token_merging(1)
    assert not np.allclose(_embed(merged), ref, atol=1e-6)
    assert _embed(_copy(model), res=64).shape == ref.shape


def test_the_record_reads_back_and_refuses_a_forged_fingerprint(model):
    space = _space(model, tome=TokenMergingRecord((1, 0)))
    doc = json.loads(json.dumps(space.to_dict()))
    assert EmbeddingSpace.from_dict(doc) == space and doc["fingerprint"] == space.fingerprint
    with pytest.raises(ValueError, match="is not that of its fields"):
        EmbeddingSpace.from_dict({**doc, "precision": "fp16"})
    older = {**doc, "fingerprint": "vs0-" + "0" * 32}  # another algorithm's: read, and hashed as this one does
    assert EmbeddingSpace.from_dict(older).fingerprint == space.fingerprint
    with pytest.raises(ValueError, match="not an embedding space record"):
        EmbeddingSpace.from_dict({k: v for k, v in doc.items() if k != "weights"})


def test_bf16_weights_hash_and_differ_from_fp32(model):
    assert weights_digest(_copy(model).to(torch.bfloat16).state_dict()) != weights_digest(model.state_dict())
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    assert weights_digest(arrays) == weights_digest(model.state_dict())  # numpy or torch: the same bytes


# ---- through vit-export, the torch backend and the Triton repository ------------------------------------------

@pytest.fixture(scope="module")
def exports(tmp_path_factory, export_tiny) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("fingerprint")
    out = folder / "out"
    common = {"out": out, "outputs": ("logits", "embedding")}
    _, ckpt = export_tiny(folder, RES, 1, ["a", "b", "c"], name="a", formats=("onnx", "triton"),
                          repo=folder / "repo", **common)
    for name, extra in (("b", {"batch": 2}), ("half", {"precision": "fp16"}), ("tome", {"tome": 1})):
        (folder / name).mkdir()  # the same weights (seed 1) saved again in a folder of its own
        export_tiny(folder / name, RES, 1, ["a", "b", "c"], name=name, **common, **extra)
    return ckpt, folder


def test_exports_and_the_served_checkpoint_share_a_fingerprint_at_the_same_settings(exports):
    from vit_serve.runtime.backends.torch import TorchBackend

    ckpt, folder = exports
    fp = {name: read_manifest(folder / "out" / f"{name}.onnx").embedding_space.fingerprint
          for name in ("a", "b", "half", "tome")}
    served = TorchBackend(ckpt).info
    print(fp, served.embedding_fingerprint())
    assert fp["a"] == fp["b"] == served.embedding_fingerprint()  # another name and batch size: the same space
    assert len({fp["a"], fp["half"], fp["tome"]}) == 3
    assert served.embedding_fingerprint(normalized=True) != fp["a"]
    assert read_manifest(folder / "out" / "a_explain.onnx").embedding_space is None  # no embedding output


def test_the_triton_configs_carry_it(exports):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    _, folder = exports
    want = read_manifest(folder / "out" / "a.onnx").embedding_space.fingerprint
    for model, has in (("a_onnx", True), ("a_py", True), ("a_ensemble", True), ("a_explain_onnx", False),
                       ("a_preprocess", False)):
        cfg = text_format.Parse((folder / "repo" / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        meta = json.loads(cfg.parameters["vit_serve"].string_value)
        got = cfg.parameters["embedding_fingerprint"].string_value if "embedding_fingerprint" in cfg.parameters \
            else None
        assert (got == want) if has else (got is None and "embedding_space" not in meta), model
        if has:
            assert meta["embedding_space"]["fingerprint"] == want
