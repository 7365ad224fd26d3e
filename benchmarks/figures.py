"""The docs' pictures, each made by the project's own commands from its own data; this one command remakes them.

    python benchmarks/figures.py [--work /tmp/vit-serve-figures] [--only inspect,drift,serving,transfer]

The model is the quickstart's (`vit-serve quickstart --no-serve --out WORK/quickstart`: the digits ViT, 4x4
patches, pre-trained at 16x16 and fine-tuned at 32x32; finished steps in WORK are reused). Into docs/assets/:

* inspect: `vit-serve inspect` on its fine-tuned checkpoint with its ten sample scans: the attention rollout (the
  paper's Fig. 6), the patch-embedding filters, the position-embedding similarity and the mean attention distance
  (Fig. 7): inspect_rollout.png, inspect_filters.png, inspect_pos_embed_similarity.png,
  inspect_mean_attention_distance.png.
* drift: `vit-serve serve` on its export; 300 held-out digits, then 300 photo crops to POST /classify; then
  `vit-serve inspect --drift URL`: drift.png.
* serving: the model served by each backend (`--backend onnxruntime` on its export, `--backend torch` on its
  checkpoint): the batch curve each gateway measured when it warmed up (GET /models: images/s by batch size),
  batch_curve.png; images/s of unique uploads (digit JPEGs) at concurrency 1, 4 and 16 (benchmarks/load_client,
  after 16 warm-up requests), throughput_concurrency.png; the numbers in serving_figures.json.
* transfer: the resolution-transfer table of benchmarks/results/digits_transfer.json (held-out top-1 by resample
  mode and transfer, before any step and after each fine-tune) as a chart: resolution_transfer.png; left out,
  with a line that says so, when that results file is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, also when loaded by path
from results_file import RESULTS, ROOT

ASSETS = ROOT / "docs" / "assets"
PARTS = ("inspect", "drift", "serving", "serving-plot", "transfer")
INSPECTED = ("rollout.png", "filters.png", "pos_embed_similarity.png", "mean_attention_distance.png")
LEVELS = (1, 4, 16)


def vit_serve_cmd(*args: str) -> None:
    """`vit-serve ARGS` in a subprocess of this Python (the CLI as a user runs it)."""
    print("$ vit-serve " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "vit_serve", *args], check=True)


def quickstart(work: Path) -> Path:
    """The quickstart's run folder, trained and exported (reused when done)."""
    out = work / "quickstart"
    vit_serve_cmd("quickstart", "--no-serve", "--out", str(out))
    return out


def inspect_figures(qs: Path, work: Path) -> list[Path]:
    folder = work / "inspect"
    shutil.rmtree(folder, ignore_errors=True)
    vit_serve_cmd("inspect", str(qs / "finetune32" / "model.safetensors"), "--images", str(qs / "samples"),
                  "--out", str(folder))
    written = []
    for name in INSPECTED:
        shutil.copyfile(folder / name, ASSETS / f"inspect_{name}")
        written.append(ASSETS / f"inspect_{name}")
    return written


def digit_bodies(n: int, offset: int = 0) -> list[bytes]:
    """`n` held-out digit scans as distinct JPEGs (128x128, as the quickstart's samples)."""
    from load_client import unique_jpeg
    from monitoring import digit_jpeg

    from vit_serve.data import digits_images

    images, _ = digits_images("test")
    return [unique_jpeg(digit_jpeg(images[i % len(images)]), offset + i) for i in range(n)]


def photo_bodies(n: int) -> list[bytes]:
    from monitoring import photo_crops

    out = []
    for im in photo_crops(n, seed=0):
        buf = io.BytesIO()
        im.convert("RGB").resize((128, 128)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def post_all(url: str, bodies: list[bytes]) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as client:
        for body in bodies:
            r = client.post("/classify", files={"file": ("a.jpg", body, "image/jpeg")})
            r.raise_for_status()


def drift_figure(qs: Path) -> list[Path]:
    from vit_serve.tune.server_process import ServerProcess

    with ServerProcess.serve([str(qs / "exports" / "digits_32.onnx")]) as server:
        post_all(server.url, digit_bodies(300))
        post_all(server.url, photo_bodies(300))
        name = _models(server.url)["models"][0]["name"]
        vit_serve_cmd("inspect", "--drift", server.url, "--model", name, "--out", str(ASSETS / "drift.png"),
                      "--force")
    return [ASSETS / "drift.png"]


def _models(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/models", timeout=30).json()


def serving_figures(qs: Path) -> list[Path]:
    """Each backend's batch curve (its gateway's own, GET /models) and its images/s by concurrency."""
    from load_client import load
    from results_file import git_commit, machine_info

    from vit_serve.tune.server_process import ServerProcess

    targets = {"onnxruntime": [str(qs / "exports" / "digits_32.onnx"), "--backend", "onnxruntime"],
               "torch": [str(qs / "finetune32" / "model.safetensors"), "--backend", "torch"]}
    curves, rates = {}, {}
    for backend, args in targets.items():
        with ServerProcess.serve(args) as server:
            version = _models(server.url)["models"][0]["versions"][0]
            curves[backend] = {int(b): v for b, v in (version.get("batching") or {}).get("images_per_s", {}).items()}
            rates[backend] = {}
            for i, c in enumerate(LEVELS):
                bodies = digit_bodies(16 + 16 * max(c, 3), offset=100_000 * (i + 1))
                rates[backend][c] = asyncio.run(load(server.url, "/classify", bodies, c, warmup=16)).throughput
        print(f"{backend}: batch curve {curves[backend]}, images/s by concurrency {rates[backend]}", file=sys.stderr)
    machine = machine_info()
    (ASSETS / "serving_figures.json").write_text(json.dumps(
        {"commit": git_commit("figures.py"), "machine": machine.describe(), "batch_curve": curves,
         "images_per_s": rates}, indent=2) + "\n")
    return plot_serving()


def plot_serving() -> list[Path]:
    """batch_curve.png and throughput_concurrency.png from docs/assets/serving_figures.json (what
    `serving_figures` measured), log-scaled: the backends differ by orders of magnitude on a busy CPU."""
    import matplotlib.pyplot as plt

    data = json.loads((ASSETS / "serving_figures.json").read_text())
    where = f"\n{data['machine'].split('; ')[0]}, {data['machine'].split('; ')[1]}" if "machine" in data else ""
    if "load average" in data.get("machine", ""):
        where += ", " + data["machine"].rsplit("; ", 1)[1]
    plots = (("batch_curve", "batch_curve.png", "batch size", "images/s (the model alone)",
              "The quickstart's model: each backend's batch curve, measured at warm-up"),
             ("images_per_s", "throughput_concurrency.png", "concurrent clients", "images/s (POST /classify)",
              "The quickstart's model served: throughput by concurrency"))
    for key, name, xlabel, ylabel, title in plots:
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
        ticks: set[int] = set()
        for backend, points in data[key].items():
            xs = [int(x) for x in points]
            ticks |= set(xs)
            ax.plot(xs, list(points.values()), marker="o", label=backend)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
        ax.set_title(title + where, fontsize=10)
        ax.set_xticks(sorted(ticks), labels=[str(t) for t in sorted(ticks)])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(ASSETS / name)
        plt.close(fig)
    return [ASSETS / "batch_curve.png", ASSETS / "throughput_concurrency.png"]


def transfer_chart() -> list[Path]:
    """digits_transfer.json's modes table: held-out top-1 (the seeds' mean) by mode, per transfer and stage."""
    from results_file import ResultsFile

    path = RESULTS / "digits_transfer.json"
    if not path.is_file():
        print(f"transfer: {path} missing (python benchmarks/digits_transfer.py): no chart", file=sys.stderr)
        return []
    results = ResultsFile.load(path)
    table = next(t for t in results.tables if t.columns[:2] == ["mode", "transfer"])
    stages = table.columns[2:]
    transfers = list(dict.fromkeys(str(r[1]) for r in table.rows))
    modes = list(dict.fromkeys(str(r[0]) for r in table.rows))
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(transfers), figsize=(max(7.0, 4.2 * len(transfers)), 4.2), dpi=110,
                             sharey=True, squeeze=False)
    cells = [_mean(c) for r in table.rows for c in r[2:]]
    low = min(c for c in cells if c == c)  # NaN ("-") left out
    width = 0.8 / len(stages)
    for ax, transfer in zip(axes[0], transfers, strict=True):
        rows = {str(r[0]): r for r in table.rows if str(r[1]) == transfer}
        for j, stage in enumerate(stages):
            values = [_mean(rows[m][2 + j]) if m in rows else np.nan for m in modes]
            ax.bar(np.arange(len(modes)) + (j - (len(stages) - 1) / 2) * width, values, width, label=stage)
        ax.set_xticks(range(len(modes)), labels=modes, rotation=30)
        ax.set_title(transfer, fontsize=10)
    axes[0][0].set_ylabel("held-out top-1 %")
    axes[0][0].set_ylim(max(0.0, low - 10), 100)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Resolution transfer of the quickstart's model by resample mode\n"
                 f"benchmarks/results/digits_transfer.json at {results.commit} (its command: the benchmark's page)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(ASSETS / "resolution_transfer.png")
    plt.close(fig)
    return [ASSETS / "resolution_transfer.png"]


def _mean(cell: object) -> float:
    """A cell of digits_transfer's table: a mean, or "mean (min-max)" over the seeds, or "-"."""
    text = str(cell).split(" ")[0]
    return float(text) if text not in ("-", "") else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vit-serve-figures",
                    help="the quickstart's run and inspect's output (reused)")
    ap.add_argument("--only", default="inspect,drift,serving,transfer",
                    help=f"a comma list of {', '.join(PARTS)} (serving-plot: draw serving's figures again from "
                         "docs/assets/serving_figures.json, without measuring)")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    if set(parts) - set(PARTS):
        ap.error(f"--only {args.only!r}: expected some of {', '.join(PARTS)}")
    ASSETS.mkdir(parents=True, exist_ok=True)
    qs = quickstart(args.work) if set(parts) - {"transfer", "serving-plot"} else args.work / "quickstart"
    written = []
    written += inspect_figures(qs, args.work) if "inspect" in parts else []
    written += drift_figure(qs) if "drift" in parts else []
    written += serving_figures(qs) if "serving" in parts else []
    written += plot_serving() if "serving-plot" in parts else []
    written += transfer_chart() if "transfer" in parts else []
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
