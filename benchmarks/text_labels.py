"""Memory of requests with labels on a real gateway (`vit-serve serve` in its own process, real sockets).

1. peak: open_clip's ViT-B/32 (random weights) converted with open_clip's 80 ImageNet templates (`convert
   --zero-shot --templates`) and exported with `--text-tower`; one `POST /classify?labels=` with 64 labels x 80
   templates (5,120 prompts). Reports the gateway's RSS idle (after one request without labels and one with a
   label: 80 prompts) and its peak during the request (the kernel's VmHWM, reset first), and the time. Target:
   peak <= 300 MB over idle (text_chunk_size: the default, or --text-chunk-size).
2. churn: a tiny CLIP (the tests' tiny tower, random weights) and N requests (default 10,000) of random-unicode
   labels, each a new one; RSS after warm-up and after the N. Target: flat within 20 MB (the tokenizer's word
   cache and the label cache are bounded).

`python benchmarks/text_labels.py [--requests N] [--labels N] [--text-chunk-size N] [--work DIR] [--skip-peak]
[--skip-churn]`; prints a table, writes benchmarks/results/text_labels.json (the parts run).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling
from results_file import ResultsFile, Table, print_checks

HERE = Path(__file__).resolve().parent


def _status(pid: int, field: str) -> float:
    """A /proc/PID/status field in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _photo() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (120, 80, 200)).save(buf, "JPEG")
    return buf.getvalue()


class Gateway(ServerProcess):
    """`vit-serve serve REPO` on a free port, in its own process, ready when made."""

    def __init__(self, repo: Path, model: str, log: Path) -> None:
        port = free_port()
        super().__init__(subprocess.Popen([str(Path(sys.executable).parent / "vit-serve"), "serve", str(repo),
                                           "--port", str(port), "--threads", "2"], stdout=log.open("w"),
                                          stderr=subprocess.STDOUT,
                                          env={**os.environ, "VIT_SERVE_DEFAULT_MODEL": model}), port)
        try:
            self.wait_ready(300, poll=0.5)
        except ServerExitedError:
            raise RuntimeError(f"the gateway exited {self.exitcode}: {log.read_text()[-2000:]}") from None
        except TimeoutError:
            self.stop()
            raise RuntimeError("the gateway did not become ready") from None

    def rss(self) -> float:
        return _status(self.proc.pid, "VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak(self) -> float:
        return _status(self.proc.pid, "VmHWM")

    def classify(self, labels: str | None, timeout: float = 900) -> httpx.Response:
        params = {} if labels is None else {"labels": labels}
        return httpx.post(f"{self.url}/classify", params=params, content=_photo(),
                          headers={"Content-Type": "image/jpeg"}, timeout=timeout)


def chunk_size() -> int:
    """The gateways' text_chunk_size: --text-chunk-size, else the default."""
    from vit_serve.runtime.zero_shot import LabelLimits

    return int(os.environ.get("VIT_SERVE_TEXT_CHUNK_SIZE", LabelLimits().chunk_size))


def clip_templates() -> list[str]:
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    return [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]


def _build(folder: Path, name: str, model, templates: list[str]) -> Path:
    import torch
    import vit_export

    from vit_serve.cli import main as serve_main

    repo = folder / f"repo_{name}"
    if (repo / f"{name}_text.onnx").is_file():  # --work: an earlier run's export
        return repo
    torch.save(model.state_dict(), folder / f"{name}.pt")
    (folder / "labels.txt").write_text("cat\ndog\n")
    (folder / f"{name}_templates.txt").write_text("\n".join(templates) + "\n")
    assert serve_main(["convert", str(folder / f"{name}.pt"), str(folder / f"{name}.safetensors"), "--arch",
                       "open_clip:ViT-B-32", "--zero-shot", str(folder / "labels.txt"), "--templates",
                       str(folder / f"{name}_templates.txt"), "--force"]) == 0
    result = vit_export.export(folder / f"{name}.safetensors", vit_export.ExportOptions(out=repo, name=name,
                                                                                        text_tower=True))
    assert result.ok and result.text is not None
    return repo


def peak(folder: Path, n_labels: int = 64) -> dict:
    import open_clip
    import torch

    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()  # random weights: nothing downloaded
    templates = clip_templates()
    repo = _build(folder, "b32", model, templates)
    del model
    gw = Gateway(repo, "b32", folder / "b32.log")
    try:
        assert gw.classify(None).status_code == 200
        assert gw.classify("warm up").status_code == 200  # the text tower's first run (80 prompts)
        time.sleep(1)
        idle = gw.rss()
        gw.reset_peak()
        labels = ",".join(f"label number {i}" for i in range(n_labels))
        t0 = time.perf_counter()
        r = gw.classify(labels)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        top = gw.peak()
        after = gw.rss()
    finally:
        gw.stop()
    return {"model": "open_clip ViT-B-32 (random weights), 80 templates", "labels": n_labels,
            "templates": len(templates), "prompts": n_labels * len(templates), "text_chunk_size": chunk_size(),
            "idle_rss_mb": round(idle, 1), "peak_rss_mb": round(top, 1), "peak_over_idle_mb": round(top - idle, 1),
            "rss_after_mb": round(after, 1), "seconds": round(took, 1), "target_mb": 300,
            "met": top - idle <= 300}


def random_label(rnd: random.Random) -> str:
    """1-8 code points from anywhere in Unicode but surrogates, commas and controls."""
    out: list[str] = []
    while len(out) < rnd.randint(1, 8):
        c = rnd.randint(0x21, 0x10FFFF)
        if 0xD800 <= c <= 0xDFFF or chr(c) in ",\x7f" or 0x80 <= c < 0xA0:
            continue
        out.append(chr(c))
    return "".join(out)


def churn(folder: Path, requests: int) -> dict:
    sys.path.insert(0, str(HERE.parent / "tests" / "export"))
    import torch
    from test_text_tower import tiny_clip

    def randomize(m, seed=0):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return m

    repo = _build(folder, "tiny", tiny_clip(randomize, seed=1), ["a photo of a {}."])
    gw = Gateway(repo, "tiny", folder / "tiny.log")
    rnd = random.Random(0)
    statuses: dict[int, int] = {}
    try:
        def one() -> None:
            r = gw.classify(",".join(random_label(rnd) for _ in range(4)), timeout=60)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        for _ in range(500):  # warm-up: the caches fill to their bounds
            one()
        warm = gw.rss()
        t0 = time.perf_counter()
        for _ in range(requests):
            one()
        took = time.perf_counter() - t0
        after = gw.rss()
    finally:
        gw.stop()
    return {"model": "tiny CLIP (width 64, 2 layers; random weights), 1 template", "requests": requests,
            "labels_per_request": 4, "statuses": statuses, "rss_after_warmup_mb": round(warm, 1),
            "rss_after_mb": round(after, 1), "growth_mb": round(after - warm, 1), "seconds": round(took, 1),
            "target_mb": 20, "met": after - warm <= 20}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000, help="requests of random-unicode labels (churn)")
    ap.add_argument("--skip-peak", action="store_true", help="only the churn part")
    ap.add_argument("--labels", type=int, default=64, help="labels of the peak's request (default 64)")
    ap.add_argument("--skip-churn", action="store_true", help="only the peak part")
    ap.add_argument("--text-chunk-size", type=int, help="the gateways' text_chunk_size (default: theirs)")
    ap.add_argument("--work", type=Path, help="a folder for the checkpoints and exports, reused by a later run "
                                              "(default: a temporary one)")
    args = ap.parse_args(argv)
    if args.text_chunk_size:
        os.environ["VIT_SERVE_TEXT_CHUNK_SIZE"] = str(args.text_chunk_size)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="text-labels-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not args.skip_peak:
            out["peak"] = peak(work, args.labels)
        if not args.skip_churn:
            out["churn"] = churn(work, args.requests)
    rows, checks = [], []
    if "peak" in out:
        p = out["peak"]
        rows.append({"part": "peak", "what": f"{p['labels']} labels x {p['templates']} templates, ViT-B/32 text "
                     f"tower (text_chunk_size {p['text_chunk_size']})", "MB over idle": p["peak_over_idle_mb"],
                     "idle MB": p["idle_rss_mb"], "seconds": p["seconds"]})
        checks.append(("peak: RSS over idle (MB)", f"{p['peak_over_idle_mb']:.0f}", "<= 300", p["met"]))
    if "churn" in out:
        c = out["churn"]
        rows.append({"part": "churn", "what": f"{c['requests']} requests of 4 random-unicode labels (statuses "
                     f"{c['statuses']})", "MB over idle": c["growth_mb"], "idle MB": c["rss_after_warmup_mb"],
                     "seconds": c["seconds"]})
        checks.append(("churn: RSS growth (MB)", f"{c['growth_mb']:+.1f}", "<= 20", c["met"]))
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    print_checks(checks)
    table = Table.from_dicts("Requests with labels on a real gateway: RSS (MB) and time", rows)
    return ResultsFile.of("text_labels", [table], checks, out, args, argv).save()

if __name__ == "__main__":
    sys.exit(main())
