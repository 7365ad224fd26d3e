"""Smoke run of benchmarks/tome.py at tiny sizes (a tiny random ViT, a tiny digits ViT trained for 200 steps,
r = 0 and 4, one round): both tables come out with a row per r and every column, r=0 agrees with itself
bit for bit, r=4 leaves 4 x depth fewer tokens, and the digits top-1 are accuracies (above chance: the trained
model learnt something). No timing asserted."""

from __future__ import annotations

from bench_script import load_script


def _table(lines: list[str], header_start: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and the body rows' cells of the markdown table whose header starts with `header_start`."""
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    cells = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
    body = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        body.append(cells(ln))
    return cells(lines[i]), body


def test_tome_prints_speed_agreement_and_digits_rows_per_r(capsys):
    m = load_script("tome")
    assert m.main(["--tiny", "--r", "0,4", "--rounds", "1", "--iters", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()

    head, rows = _table(lines, "| r | tokens left |")
    assert head == ["r", "tokens left",
                    "torch img/s", "torch / r=0",
                    "onnxruntime fp32 img/s", "onnxruntime fp32 / r=0",
                    "onnxruntime int8 img/s", "onnxruntime int8 / r=0",
                    "top-1 agreement", "mean abs logit delta", "int8 top-1 agreement", "int8 mean abs logit delta"]
    assert [r[0] for r in rows] == ["0", "4"]
    assert all(len(r) == len(head) for r in rows)
    by_r = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
    tiny_depth = m.TINY_MODEL["depth"]
    assert by_r["0"]["tokens left"] == "65"  # 32 px / patch 4: 64 patches + [class]
    assert by_r["4"]["tokens left"] == str(65 - 4 * tiny_depth)
    for c in ("torch / r=0", "onnxruntime fp32 / r=0", "onnxruntime int8 / r=0"):
        assert by_r["0"][c] == "1.00x"
        assert float(by_r["4"][c].rstrip("x")) > 0
    assert by_r["0"]["top-1 agreement"] == "100.0%"
    assert by_r["0"]["mean abs logit delta"] == "0.0000"
    for r in by_r.values():
        for c in ("top-1 agreement", "int8 top-1 agreement"):
            assert 0 <= float(r[c].rstrip("%")) <= 100
    assert float(by_r["4"]["mean abs logit delta"]) > 0  # the merging changed something

    head, rows = _table(lines, "| r | digits r |")
    assert head == ["r", "digits r", "digits tokens left", "torch top-1", "onnxruntime int8 top-1"]
    assert [r[0] for r in rows] == ["0", "4"]
    assert [r[1] for r in rows] == ["0", "4"]  # the same depth and patches: the same fraction, the same r
    for r in rows:
        for acc in r[3:]:
            assert 0.2 <= float(acc.rstrip("%")) / 100 <= 1  # a digits accuracy, above chance (0.1)
    assert any(ln.startswith("target (r=13") for ln in lines)
