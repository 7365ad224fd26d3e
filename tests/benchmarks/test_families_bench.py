"""Smoke runs of benchmarks/families.py (timm's own models against ours, every family) and
benchmarks/embed_dinov2.py (the gateway's POST /embed against predict --embeddings) at tiny sizes: the tables
come out with every row. Reference: timm (random weights, `pretrained=False`); no timing asserted."""

from __future__ import annotations

from bench_script import load_script


def test_families_prints_a_row_per_family_and_ours_equals_timm(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = load_script("families")
    m.main(["--tiny", "--part", "timm", "--batch", "2", "--rounds", "1", "--iters", "1"])
    out = capsys.readouterr().out
    table = out.split("| check | value |")[0]  # the families' table, not the checks' after it
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "timm model" not in ln]
    assert [r.split(" | ")[1] for r in rows] == [f.timm_name for f in m.FAMILIES]
    assert all(r.endswith("| 0.0e+00 |") for r in rows), rows  # bit-exact: timm's state dict, our model


def test_embed_dinov2_prints_the_gateway_the_offline_rate_and_their_ratio(capsys, tmp_path):
    m = load_script("embed_dinov2")
    assert m.main(["--tiny", "--corpus", "small", "--images", "4", "--rounds", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("| gateway POST /embed, c=16", "| predict --embeddings over 4 files", "| ratio /embed / predict"):
        assert row in out, out
    assert "dim 32," in out  # the tiny tower's width: /embed and predict both answered with the embedding


def test_families_rope_part_sets_each_rope_family_beside_a_plain_vit(capsys):
    """--part rope --tiny: a row per RoPE family (timm's Eva) with both rates beside the plain ViT's and the node
    counts; our eager logits equal timm's and onnxruntime's equal ours (the checks pass)."""
    m = load_script("families")
    rope = load_script("families_rope")
    assert m.main(["--tiny", "--part", "rope", "--rope-batch", "1", "--rounds", "1", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split(" | ") for ln in out.split("| check | value |")[0].splitlines()
            if ln.startswith("| ") and "timm model" not in ln]
    assert [r[1] for r in rows] == [f.timm_name for f in rope.ROPE_FAMILIES]
    for r in rows:
        eager, plain_eager, ort, plain_ort, nodes, plain_nodes = (float(r[i]) for i in (4, 5, 7, 8, 10, 11))
        assert min(eager, plain_eager, ort, plain_ort) > 0 and nodes > 0 and plain_nodes > 0
    assert out.count("| pass |") == 2 * len(rope.ROPE_FAMILIES) and "| FAIL |" not in out
