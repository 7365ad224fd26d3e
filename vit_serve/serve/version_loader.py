"""How a gateway builds the `ModelVersion`s that its repository decides to serve (`VersionLoader`).

The repository (`repository.ModelRepository`) decides which versions of which models are loaded and when; the
loader holds what building one takes and the repository has no use for: how models load (`LoadSpec`: REPO, the
backend, the device, the server's model defaults), the gateway's metrics, decode pool and crop store, and the
decoding, label and monitoring settings each version is given. It scans REPO (or asks the Triton server), and loads,
warms up and equips one version: its own model thread and runner (`scheduling.runner_for`) with the model's limits
(its config over the server's defaults), its GPU decoder, its text tower and its monitor.

The model threads share the machine: unless `--threads` is set, a repository of n models gives each model
max(1, cores // n) intra-op threads (one model keeps its runtime's default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vit_serve.runtime.backends import Backend, load
from vit_serve.runtime.discovery import ModelEntry, VersionSource, scan
from vit_serve.runtime.errors import BackendUnavailableError
from vit_serve.runtime.gpu_decode import GpuDecoder, choose_decoder
from vit_serve.runtime.model_config import ModelConfig
from vit_serve.runtime.scheduling import runner_for
from vit_serve.runtime.spec import LoadSpec, resolve_backend
from vit_serve.runtime.text_tower import TextTower, holds_text_tower, text_tower_of
from vit_serve.runtime.zero_shot import LabelLimits
from vit_serve.serve.metrics import GatewayMetrics, RunnerEvents
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.monitoring import VersionMonitor
from vit_serve.serve.settings import DEFAULT_LABELS, MonitoringSettings, available_cpus
from vit_serve.serve.stores import CropStore
from vit_serve.serve.version_decode import VersionDecoder

log = logging.getLogger("vit_serve.serve")


class VersionRefusedError(Exception):
    """A version that could not be loaded or warmed up; its message is the reason the index shows."""


def rss_bytes() -> int | None:
    """The process's resident memory (Linux /proc; None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_memory(rss0: int | None, rss1: int | None, source: VersionSource, remote: bool) -> int | None:
    """What a version took to load: the process's RSS growth over the load and warm-up, but never less than its
    weights file when the model runs in this process. The floor matters because RSS growth alone reads 0 when the
    allocator reuses pages freed by an earlier model, or is split oddly when several versions load at once."""
    if rss0 is None or rss1 is None:
        return None
    grown = max(0, rss1 - rss0)
    if remote:  # the server holds the weights
        return grown
    try:
        return max(grown, source.path.stat().st_size)
    except OSError:
        return grown


def model_device(backend: Backend) -> str:
    """Where a backend's model runs: "cpu", "cuda[:i]", or (a remote server) "the <backend> server"."""
    device = backend.info.device
    return f"the {backend.name} server" if device == "remote" else device


class VersionLoader:
    """Scans REPO and builds its versions. spec: REPO (`spec.path`) and how its models load (each version's spec is
    this one with its file, backend, name and threads, under its model's config); max_pixels and gpu_decode: how
    each version decodes uploads; label_limits: requests with labels and each text tower's cache; monitoring: OOD
    scores and drift of the models that carry a reference."""

    def __init__(self, spec: LoadSpec, metrics: GatewayMetrics, pool: ThreadPoolExecutor, store: CropStore, *,
                 max_pixels: int, gpu_decode: bool, label_limits: LabelLimits = DEFAULT_LABELS,
                 monitoring: MonitoringSettings | None = None) -> None:
        self.spec, self.metrics, self.pool, self.store = spec, metrics, pool, store
        self.max_pixels, self.gpu_decode = max_pixels, gpu_decode
        self.label_limits = label_limits
        self.monitoring = monitoring or MonitoringSettings()

    @property
    def root(self) -> str:
        """REPO as given (a folder, one model's file or folder, a hub id, a Triton model name, or "")."""
        return self.spec.path

    @property
    def one_model(self) -> bool:
        """Whether one model was given (a file, a checkpoint folder, a hub id, a Triton model name): it must load."""
        spec, root = self.spec, Path(self.spec.path)
        return bool(spec.path) and (spec.backend == "triton" or not root.is_dir() or (root / "config.json").is_file())

    async def first_scan(self) -> dict[str, ModelEntry]:
        """The models of REPO at start-up: a Triton server that is still starting is waited for as for one model."""
        spec = self.spec
        if not (spec.backend == "triton" and not spec.path):
            return await self.scan()
        deadline = time.monotonic() + spec.triton.triton_startup_timeout_s
        while True:
            try:
                return await self.scan()
            except BackendUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.25)

    async def scan(self) -> dict[str, ModelEntry]:
        spec = self.spec
        if spec.backend == "triton":
            if spec.path:  # one model of the Triton server, by its name there
                name = spec.name or spec.path
                return {name: ModelEntry(name, {1: VersionSource(name, 1, Path(spec.path), "triton")})}
            from vit_serve.runtime.backends.triton import vit_models  # every ViT model the server serves

            models = await vit_models(spec.triton.triton_url, spec.triton.triton_timeout_s)
            return {n: ModelEntry(n, {v: VersionSource(n, v, Path(n), "triton")}) for n, v in models.items()}
        return await asyncio.get_running_loop().run_in_executor(None, scan, spec.path, spec.name)

    def _threads(self, models: int, instances: int) -> int | None:
        """Intra-op threads of each instance of a model: `--threads`, else the cores shared by the `models` and
        their instances (None: one model of one instance keeps its runtime's default)."""
        if self.spec.threads is not None:
            return self.spec.threads
        n = max(1, models) * instances
        return None if n == 1 else max(1, available_cpus() // n)

    def _monitoring_of(self, config: ModelConfig) -> MonitoringSettings:
        """The gateway's monitoring settings, with the model's own `monitoring` and `drift_window`."""
        changes = config.monitoring_changes()
        if "drift_window" in changes:  # the alarm's minimum window never above the window
            changes["drift_min_window"] = min(self.monitoring.drift_min_window, changes["drift_window"])
        return self.monitoring.model_copy(update=changes) if changes else self.monitoring

    async def load(self, source: VersionSource, config: ModelConfig, models: int, warm_first: bool) -> ModelVersion:
        """Load, then warm up (`warm_first`; else in the background), one version in its own new model thread, under
        its model's `config` (`models`: how many models share the machine); VersionRefusedError when either fails."""
        loop = asyncio.get_running_loop()
        limits = config.over(self.spec.limits)
        thread = ThreadPoolExecutor(limits.instances, thread_name_prefix=f"vit-serve-model-{source.name}")
        # --backend openvino serves the repository's ONNX exports too (the scan names onnxruntime for .onnx).
        backend = "openvino" if self.spec.backend == "openvino" and source.backend == "onnxruntime" else source.backend
        spec = self.spec.replace(path=str(source.path), backend=backend, name=source.name,
                                 threads=self._threads(models, limits.instances), limits=limits)
        if self.spec.backend == "auto" and resolve_backend(spec.replace(backend="auto")) == backend:
            spec = spec.replace(backend="auto")  # left to the file: the runtime may be chosen by measurement
        if not self.one_model and resolve_backend(spec) != "torch":  # --tome, --compile, --torchscript: checkpoints
            spec = spec.replace(tome=None, compile=False, torchscript=False)
        spec = config.spec(spec)
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        try:
            backend = await loop.run_in_executor(thread, load, spec)
        except Exception as e:
            thread.shutdown(wait=False, cancel_futures=True)
            raise VersionRefusedError(f"cannot load: {' '.join(str(e).split()) or type(e).__name__}") from e
        info = backend.info
        log.info("loaded %s (%s backend), version %d: %dx%d, %d classes, explain=%s", source.name, backend.name,
                 source.version, *info.resolution, info.num_classes, info.explain)
        metrics = self.metrics.for_model(source.name, str(source.version))
        runner = runner_for(backend, limits, RunnerEvents(metrics), thread)
        runner.start()
        device = model_device(backend)
        off = choose_decoder(device, self.gpu_decode, source.name)
        gpu = None
        if off is None:
            gpu = GpuDecoder(info.preprocess, self.max_pixels, device, runner.limits.max_batch,
                             lambda reason: self.metrics.gpu_decode_fallbacks.labels(reason).inc())
        decoder = VersionDecoder(info.preprocess, self.pool, self.store, self.max_pixels, gpu, off,
                                 info.patch_size)
        text, text_error = await self._text_tower(source, spec, info.device, thread, backend.name)
        version = ModelVersion(source.name, source.version, backend, runner, thread, metrics, decoder,
                               source.fingerprint, label_limits=self.label_limits, text=text, text_error=text_error,
                               monitor=VersionMonitor.of(info, self._monitoring_of(config), metrics))
        if not warm_first:
            version.warm_up_soon()
        elif not await version.warm_up():
            await version.close()
            raise VersionRefusedError(version.error or "warm-up failed")
        version.memory_bytes = load_memory(rss0, rss_bytes(), source, info.device == "remote")
        if version.memory_bytes is not None:
            metrics.memory.set(version.memory_bytes)
        log.info("%s in service after %.2f s", version.label, time.perf_counter() - t0)
        return version

    async def _text_tower(self, source: VersionSource, spec: LoadSpec, runs_on: str, thread: ThreadPoolExecutor,
                          runtime: str = "onnxruntime") -> tuple[TextTower | None, str | None]:
        """(the text tower beside the version's file, `NAME_text.onnx`, or else the one a checkpoint served with
        torch stores, loaded in the version's model thread, or None; why it could not be loaded, or None). One that
        fails leaves the version serving images, its reason kept (`text_error`, in the 400 answers to requests
        with labels)."""
        path = text_tower_of(source.path) if source.backend != "triton" else None
        stored = path is None and source.backend == "torch" and holds_text_tower(source.path)
        if stored:
            path = Path(source.path)
        if path is None:
            return None, None
        label = f"{source.name} version {source.version}"
        device = "cpu" if runs_on in ("cpu", "remote") else spec.device

        def load() -> TextTower:
            if stored:
                return TextTower.from_checkpoint(path, None, device, self.label_limits)
            return TextTower(path, None, device, spec.threads, self.label_limits,
                             runtime="openvino" if runtime == "openvino" else "onnxruntime")

        try:
            text = await asyncio.get_running_loop().run_in_executor(thread, load)
        except Exception as e:
            error = f"{path.name}: {' '.join(str(e).split()) or type(e).__name__}"
            log.warning("%s: its text tower is not served: %s", label, error)
            return None, error
        log.info("%s: text tower %s (%s scores, labels cached: %d)", label, path.name, text.scores,
                 self.label_limits.cache_size)
        return text, None
