"""Zero-shot abstention (issue 42): how often `?labels=...&abstain=true` answers "none of these", in-set and out of set.

    python benchmarks/zero_shot_abstention.py --model M.safetensors   # default: train the quickstart's digits model

The model: the quickstart's digits ViT made zero-shot-style: its head replaced by class embeddings (each digit's
training embeddings, L2-normalised, averaged, renormalised: `vit_serve.zeroshot.class_embeddings`, the recipe a text
tower's label prompts go through) and CLIP's logits, 100 x cosine; scores softmax over the ten labels. Its
reference (`monitor.build_reference`: fit on the training digits, calibrated on one half of the held-out digits)
sets the threshold (`monitor.abstain_threshold`: the 0.05 quantile of the calibration images' best score); the
decision is the gateway's own (`runtime.postprocess.by_labels` then `abstain`). Measured on the other half of the
held-out digits (in-set), random square crops of scikit-image's photos and whole photos (scikit-image's astronaut,
coffee, chelsea, rocket, camera; matplotlib's grace_hopper), at the calibrated threshold and at thresholds a
request may give. Prints a markdown table; saves benchmarks/results/zero_shot_abstention.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vit_serve
from vit_serve import monitor
from vit_serve.preprocess import PreprocessConfig
from vit_serve.runtime.postprocess import abstain, by_labels
from vit_serve.zeroshot import class_embeddings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from monitoring import Outputs, outputs, photo_crops, table, train_quickstart
from results_file import print_checks, record_printed

SCALES = (100.0, 10.0)  # CLIP's logit scale (exp(4.6052)), and a softer one whose softmax does not saturate
LABELS = [str(d) for d in range(10)]
WHOLE = ("astronaut", "coffee", "chelsea", "rocket", "camera")
REQUEST_THRESHOLDS = (0.5, 0.9, 0.99)
IN_SET_TARGET = 0.10  # abstain on at most this share of in-set digits at the calibrated threshold


def whole_photos() -> list[Image.Image]:
    """scikit-image's sample photos and matplotlib's grace_hopper, whole."""
    import skimage.data as skd
    from matplotlib import cbook

    out = [Image.fromarray(getattr(skd, name)()).convert("RGB") for name in WHOLE]
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        out.append(Image.open(f).convert("RGB"))
    return out


def zero_shot(o: Outputs, classes: np.ndarray, scale: float) -> np.ndarray:
    """logits [N, 10]: `scale` x cosine of each embedding with each class embedding."""
    e = o.emb / np.linalg.norm(o.emb, axis=-1, keepdims=True)
    return (scale * e @ classes.T).astype(np.float32)


def abstained(logits: np.ndarray, threshold: float, source: str) -> float:
    """The share of rows the gateway's decision answers "none of these"."""
    return float(np.mean([abstain(by_labels(row, LABELS, 5, "softmax"), threshold, source).abstention.abstained
                          for row in logits]))


def run(argv: list[str] | None = None) -> int:
    from vit_serve.data import digits_images

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a digits model (.safetensors); default: train the quickstart's")
    p.add_argument("--work", type=Path, default=Path("/tmp/vit_serve_monitoring"))
    p.add_argument("--crops", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = vit_serve.load(args.model or train_quickstart(args.work)).eval()
    cfg = model.preprocess_cfg or PreprocessConfig(input_size=model.cfg.img_size)
    tr, ytr = digits_images("train")
    te, yte = digits_images("test")
    fit, held = outputs(model, tr, cfg, ytr), outputs(model, te, cfg, yte)
    per_digit = [fit.emb[fit.labels == d] for d in range(10)]
    classes = np.stack([class_embeddings(e, len(e))[0] for e in per_digit])
    order = np.random.default_rng(args.seed).permutation(len(held))
    calib, test = held.take(np.sort(order[:len(held) // 2])), held.take(np.sort(order[len(held) // 2:]))
    outs = {"in-set digits": test, "photo crops": outputs(model, photo_crops(args.crops, args.seed), cfg),
            "whole photos": outputs(model, whole_photos(), cfg)}
    accuracy = float((zero_shot(test, classes, 1.0).argmax(-1) == test.labels).mean())
    print(f"zero-shot-style digits model: accuracy {accuracy:.3f} on {len(test)} in-set digits; calibrated on "
          f"{len(calib)} other held-out digits; {args.crops} photo crops, {len(WHOLE) + 1} whole photos\n")
    rows, checks = [], []
    for scale in SCALES:
        ref = monitor.build_reference(fit.emb, zero_shot(fit, classes, scale), calib.emb,
                                      zero_shot(calib, classes, scale), scores="softmax", source="digits")
        calibrated = monitor.abstain_threshold(ref)
        for t, source in ((calibrated, "reference"), *((t, "request") for t in REQUEST_THRESHOLDS)):
            rate = {name: abstained(zero_shot(o, classes, scale), t, source) for name, o in outs.items()}
            rows.append([f"{scale:g}", f"{t:.9g} ({source})", *(f"{rate[n]:.3f}" for n in outs)])
            if source == "reference":
                checks += [(f"scale {scale:g}: in-set abstention at the calibrated threshold",
                            f"{rate['in-set digits']:.3f}", f"<= {IN_SET_TARGET}",
                            rate["in-set digits"] <= IN_SET_TARGET),
                           (f"scale {scale:g}: photo crops abstain more than in-set digits",
                            f"{rate['photo crops']:.3f}", f"> {rate['in-set digits']:.3f}",
                            rate["photo crops"] > rate["in-set digits"])]
    print("abstention rate (share answered \"none of these\") by logit scale and threshold on the best label's "
          "score\n")
    print(table(["logit scale", "threshold", *outs], rows))
    print_checks(checks)
    return 0 if all(c[3] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(record_printed("zero_shot_abstention", run))
