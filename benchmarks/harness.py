"""The benchmarks' server harness: one gateway process per configuration, ready, stopped, and the results saved.

Every benchmark that starts a server starts it here (or with `vit_serve.tune.server_process`, on which this
stands, as `vit-serve tune` does): `Server` is the gateway on an export, configured through its VIT_SERVE_*
variables and run under uvicorn as `vit-serve serve` runs it (`server_config`), in a subprocess; it reports the
settings it resolved (`Server.settings`), its CPU time and its memory. `export_model` makes the export it serves,
`routing_repository` a repository of copies of it. `print_checks` prints a run's checks and `save_results` writes
them with its numbers to a JSON file (`results_path(NAME)`: benchmarks/results/NAME.json, which the README's
tables are rendered from). The clients and the uploads they send are `load_client`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vit_serve.tune.server_process import ServerExitedError, ServerProcess, free_port

__all__ = ["ROUTING_MODELS", "Server", "ServerExitedError", "ServerProcess", "export_model", "find_onnx",
           "free_port", "memory_ceiling", "print_checks", "results_path", "routing_repository", "save_results"]

RESULTS = Path(__file__).resolve().parent / "results"
ROUTING_MODELS = ("a", "b", "c")

# uvicorn as `vit-serve serve` configures it (server_config: header timeout, connection cap, half-close), the
# settings it resolved printed first. A gateway older than server_config (the lifecycle benchmark's baseline tree)
# runs under uvicorn's own defaults, as it was served then.
SERVER_CODE = """
import sys, uvicorn
from vit_serve.serve import app as gateway_app
from vit_serve.serve.settings import ServeSettings
s = ServeSettings()
print('SETTINGS ' + s.model_dump_json(), file=sys.stderr, flush=True)
app = gateway_app.create_app(s)
if hasattr(gateway_app, 'server_config'):
    config = gateway_app.server_config(app, s, host=s.host, port=s.port, log_level='warning')
else:
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level='warning')
uvicorn.Server(config).run()
"""


# ---- the model ---------------------------------------------------------------------------------------------

def export_model(arch: str | Callable[[], Any], res: int, out: Path, outputs: str = "logits") -> Path:
    """A random-weight `arch` checkpoint at `res` (or the model `arch()` builds), exported by vit-export into
    out/export with `outputs` ("logits" or "logits,embedding"); returns model.onnx."""
    import torch
    import vit_export

    import vit_serve

    onnx = out / "export" / "model.onnx"
    if onnx.is_file():
        print(f"reusing {onnx}", file=sys.stderr)
        return onnx
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "model.safetensors"
    if not ckpt.is_file():
        torch.manual_seed(0)
        model = vit_serve.create_model(arch, num_classes=1000, img_size=res) if isinstance(arch, str) else arch()
        vit_serve.save(model, ckpt)
    result = vit_export.export(ckpt, vit_export.ExportOptions(res=res, out=onnx.parent, name="model",
                                                              outputs=outputs),
                               progress=lambda msg: print(msg, file=sys.stderr))
    if not result.ok:
        raise SystemExit(f"the export of {ckpt} failed its parity checks (tables above)")
    return result.onnx


def find_onnx(path: Path) -> Path:
    """An export folder's one logits graph (NAME.onnx beside NAME_explain.onnx), or the .onnx file given."""
    if path.is_file():
        return path
    graphs = sorted(p for p in path.glob("*.onnx") if not p.stem.endswith("_explain"))
    if len(graphs) != 1:
        raise SystemExit(f"--export {path}: expected one NAME.onnx there, found {[g.name for g in graphs] or 'none'}")
    return graphs[0]



# ---- the server --------------------------------------------------------------------------------------------

class Server(ServerProcess):
    """`vit-serve`'s gateway on `onnx` under uvicorn in a subprocess, configured through its VIT_SERVE_* variables
    (`env`: more of them, e.g. {"VIT_SERVE_DECODE": "fast"}); `settings`, once it is ready: what it resolved, the
    groups' fields (limits, security, ...) by their flat names too, as VIT_SERVE_* names them."""

    def __init__(self, onnx: Path, threads: int | None, device: str, max_batch: int, max_delay_ms: float,
                 env: dict[str, str] | None = None) -> None:
        port = free_port()
        env = {**os.environ,
               "VIT_SERVE_MODEL": str(onnx), "VIT_SERVE_BACKEND": "onnxruntime", "VIT_SERVE_DEVICE": device,
               "VIT_SERVE_MAX_BATCH": str(max_batch), "VIT_SERVE_MAX_DELAY_MS": str(max_delay_ms),
               "VIT_SERVE_MAX_QUEUE": "1024", "VIT_SERVE_HOST": "127.0.0.1", "VIT_SERVE_PORT": str(port),
               **({"VIT_SERVE_THREADS": str(threads)} if threads else {}), **(env or {})}
        super().__init__(subprocess.Popen([sys.executable, "-c", SERVER_CODE], env=env, stderr=subprocess.PIPE,
                                          text=True), port)
        self.settings: dict = {}

    def wait_ready(self, timeout: float | None = None, poll: float = 0.2, tick=lambda: None) -> dict:
        if not self.settings:
            self._read_settings()
        return super().wait_ready(timeout, poll, tick)

    def _read_settings(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # the settings line, after whatever the runtimes warn at import
            if line.startswith("SETTINGS "):
                dump = json.loads(line.removeprefix("SETTINGS "))
                self.settings = {**dump, **{k: v for group in dump.values() if isinstance(group, dict)
                                            for k, v in group.items()}}
                break
            sys.stderr.write(line)
        else:
            raise ServerExitedError(f"the server exited with status {self.proc.wait()} before it started")
        # the rest of its stderr goes to ours, so that it never blocks on a full pipe
        self._relay = threading.Thread(target=lambda: [sys.stderr.write(ln) for ln in self.proc.stderr],
                                       daemon=True)
        self._relay.start()


def routing_repository(onnx: Path, folder: Path) -> Path:
    """A repository of three models, each a copy of the export (`NAME/1/model.onnx`, its manifest and explain
    graph): what a gateway serving several models holds."""
    for name in ROUTING_MODELS:
        version = folder / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        for suffix in (".onnx", ".json", "_explain.onnx", "_explain.json"):
            src = onnx.with_name(onnx.stem + suffix)
            if src.exists():
                (version / f"model{suffix}").write_bytes(src.read_bytes())
    return folder


def memory_ceiling(idle_mb: float, settings: dict, concurrency: int, input_hw: tuple[int, int]) -> float:
    """The most memory (MB) the server's settings let `concurrency` uploads take above its idle RSS.

    * bodies being read: each at most max_body_bytes, twice (the parser's buffers and the joined bytes), one per
      connection (how many connections is the client's, or uvicorn's --limit-concurrency, not a gateway setting);
    * decodes: decode_workers threads, each one full-size decode of at most max_pixels, RGB, plus one
      intermediate of that size (the fast path's are much smaller: the JPEG is decoded at 1/2 to 1/8 scale);
    * model inputs waiting: max_queue float32 [3, H, W] tensors, and the store: store_size RGB H x W crops
      (`input_hw`, the model's input).
    """
    pixels = input_hw[0] * input_hw[1]
    body = 2 * settings["max_body_bytes"] * concurrency
    decode = settings["decode_workers"] * 2 * 3 * settings["max_pixels"]
    queue = settings["max_queue"] * 4 * 3 * pixels
    store = settings["store_size"] * 3 * pixels
    return idle_mb + (body + decode + queue + store) / 2**20



# ---- the results -------------------------------------------------------------------------------------------

def print_checks(checks: list[tuple[str, str, str, bool]]) -> None:
    print("\n| check | value | target | |\n|---|---:|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value} | {target} | {'pass' if ok else 'FAIL'} |")



def results_path(name: str) -> Path:
    """benchmarks/results/NAME.json: where a benchmark's results live with the code (the README's tables)."""
    return RESULTS / f"{name}.json"


def save_results(path: Path, results: dict, checks: list[tuple[str, str, str, bool]], overwrite: bool = False) -> int:
    """Write `results` with the checks to `path` (atomically; an existing file only with `overwrite`) and say
    where; the exit code: 0 when every check passed, else 1."""
    from vit_serve.checkpoints.io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    results = {**results, "checks": [{"check": n, "value": v, "target": t, "pass": ok} for n, v, t, ok in checks]}
    atomic_write(path, json.dumps(results, indent=2).encode(), overwrite=overwrite)
    print(f"\nresults: {path}")
    return 0 if all(ok for *_, ok in checks) else 1
