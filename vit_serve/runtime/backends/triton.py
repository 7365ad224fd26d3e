"""The Triton backend: a model on a Triton Inference Server, reached with tritonclient's asyncio client.

A `RemoteBackend`: the gateway sends every request straight to Triton; the server's dynamic batcher groups
concurrent requests into one execution. The model's metadata (resolution, labels, preprocessing contract, patch
size, explain model, rollout settings) is read from the "vit_serve" parameter the exporter writes into each
config.pbtxt, so the gateway needs nothing but the model name and the server's URL.

Under load, one request's failure stays its own. Each Triton call has its own deadline (`triton_timeout_s`):
a call past it answers 504 and nothing else happens to the shared connection. The HTTP client's pool holds
`max_queue` connections (plus a few for probes), as many as the gateway lets be outstanding, so no request
spends its deadline waiting for a connection. A server that is down, refusing connections or without the model
loaded gives `BackendUnavailableError` (503) for the calls it fails; aiohttp's pool drops broken connections
on its own, and a gRPC channel whose connection failed is replaced for new calls and closed once the calls still
on it have finished, so the backend reconnects by itself once the server is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from vit_serve.manifest import EMBEDDING, LOGITS, PIXEL_VALUES, ROLLOUT, TritonMeta
from vit_serve.runtime.backends.base import NO_OPTIONS, CallOptions, ModelInfo, RemoteBackend
from vit_serve.runtime.errors import BackendUnavailableError, ModelTimeoutError
from vit_serve.runtime.settings import TritonClientSettings
from vit_serve.runtime.task import Outputs, Task
from vit_serve.runtime.trace_context import context_headers

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
# Connections beyond max_queue: readiness probes and the parts of a batch split over max_batch_size.
SPARE_CONNECTIONS = 8
GRPC_MESSAGE_LIMITS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
# Triton's answers that mean "not now" rather than "bad request": server / model missing, loading or overloaded.
UNAVAILABLE_STATUSES = {"503", "StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"}
TIMEOUT_STATUSES = {"StatusCode.DEADLINE_EXCEEDED"}
UNAVAILABLE_WORDS = ("unknown model", "not found", "not ready", "unavailable", "is not loaded")
# gRPC's wording when the connection itself failed (the channel is then replaced, not left to its backoff).
CONNECTION_WORDS = ("failed to connect", "socket closed", "connection reset", "connection refused", "broken pipe")


def parse_url(url: str) -> tuple[str, str]:
    """'http://host:port' | 'grpc://host:port' | 'host:port' (HTTP) -> (protocol, 'host:port')."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    protocol = parts.scheme.lower()
    if protocol not in DEFAULT_PORTS:
        raise ValueError(f"unsupported Triton URL scheme {parts.scheme!r} in {url!r}; use http://HOST:PORT or "
                         f"grpc://HOST:PORT")
    if not parts.hostname:
        raise ValueError(f"no host in Triton URL {url!r}; use http://HOST:PORT or grpc://HOST:PORT")
    if parts.path not in ("", "/"):
        raise ValueError(f"Triton URL {url!r} must not have a path")
    return protocol, f"{parts.hostname}:{parts.port or DEFAULT_PORTS[protocol]}"


def model_info(model: str, config: dict[str, Any], source: str) -> ModelInfo:
    """ModelInfo of the logits model `model` from its config (get_model_config as JSON)."""
    meta = TritonMeta.from_config(config, model)
    inputs = {i.get("name"): i.get("data_type") for i in config.get("input", [])}
    if meta.kind != "logits" or inputs.get(PIXEL_VALUES) != "TYPE_FP32":
        raise ValueError(f"Triton model {model!r} is not a logits model taking {PIXEL_VALUES!r} (it is a {meta.kind} "
                         f"model); serve {meta.name}_py, {meta.name}_onnx or {meta.name}_trt")
    logits = next((o for o in config.get("output", []) if o.get("name") == LOGITS), None)
    if logits is None:
        raise ValueError(f"Triton model {model!r} has no {LOGITS!r} output")
    # The batch dimension is implicit when max_batch_size > 0, so dims is [K]; gRPC JSON gives int64 as strings.
    num_classes = int(logits["dims"][-1])
    labels = None if meta.labels is None else list(meta.labels)
    if num_classes <= 0:
        num_classes = len(labels or [])
    resolution = meta.serving_resolution
    embedding = next((o for o in config.get("output", []) if o.get("name") == EMBEDDING), None)
    return ModelInfo(
        name=model,
        resolution=resolution,
        patch_size=meta.patch_size,
        num_classes=num_classes,
        labels=labels,
        preprocess=meta.preprocess.with_size(*resolution),
        explain=bool(meta.explain_model),
        rollout=meta.rollout,
        source=source,
        backend="triton",
        device="remote",
        pool=meta.pool,
        precision=meta.precision or "fp32",
        dynamic_resolution=meta.resolution == "dynamic",
        runtime=meta.runtime or config.get("platform") or config.get("backend", ""),
        explain_model=meta.explain_model,
        max_batch_size=int(config.get("max_batch_size", 0)),
        embedding_dim=0 if embedding is None else int(embedding["dims"][-1]),
        scores=meta.scores or "softmax",
        token_merging=meta.token_merging,
        embedding=meta.embedding,
        embedding_space=None if embedding is None else meta.embedding_space,
        # a reference that scores the embedding needs the model to give it (a TensorRT model does not)
        reference=None if meta.reference is None or (meta.reference.needs_embedding and embedding is None)
        else meta.reference,
    )


def _close_soon(conn: _Connection) -> None:
    """Close a retired connection on its own loop, without waiting for it here."""
    async def close() -> None:
        with contextlib.suppress(Exception):  # closing a broken connection may fail in many ways
            await conn.client.close()

    if conn.loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is conn.loop:
        _closing.add(task := conn.loop.create_task(close()))
        task.add_done_callback(_closing.discard)
    elif conn.loop.is_running():
        asyncio.run_coroutine_threadsafe(close(), conn.loop)


_closing: set[asyncio.Task[None]] = set()  # strong references: the event loop keeps only weak ones


def _run_blocking(make_coro) -> Any:
    """Run a coroutine to completion from sync code, whether or not this thread already runs an event loop."""
    with ThreadPoolExecutor(1, thread_name_prefix="triton-sync") as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


@dataclass
class _Connection:
    """The shared client of one event loop, with the number of calls on it (a retired one closes when idle)."""

    client: Any
    loop: asyncio.AbstractEventLoop
    shared: bool = True  # False: a short-lived client of one sync call, closed by its caller
    calls: int = 0
    retired: bool = False


async def vit_models(url: str, timeout_s: float = 10.0) -> dict[str, int]:
    """The ViT models a Triton server serves, {name: newest READY version}: the READY models of its repository
    index whose config carries vit-export's "vit_serve" parameter as a logits model taking pixel_values (not the
    explain, preprocessing or ensemble models, which the gateway reaches through their logits model)."""
    protocol, address = parse_url(url)
    if protocol == "http":
        import tritonclient.http.aio as tc

        client = tc.InferenceServerClient(address, conn_timeout=timeout_s)
        kw: dict[str, Any] = {}
    else:
        import tritonclient.grpc.aio as tc

        client = tc.InferenceServerClient(address)
        kw = {"as_json": True, "client_timeout": timeout_s}
    try:
        async with asyncio.timeout(timeout_s):
            index = await client.get_model_repository_index(**kw)
            rows = index.get("models", []) if isinstance(index, dict) else index  # gRPC wraps the list
            ready: dict[str, int] = {}
            for row in rows:
                if row.get("state") == "READY":
                    ready[row["name"]] = max(ready.get(row["name"], 0), int(row.get("version") or 1))
            found = {}
            for name, version in sorted(ready.items()):
                raw = await client.get_model_config(name, **kw)
                try:
                    model_info(name, raw.get("config", raw), "")
                except ValueError:
                    continue  # not a ViT logits model (or not one of vit-export's)
                found[name] = version
            return found
    except Exception as e:  # tritonclient's and aiohttp's errors: the server is not there or not answering
        raise BackendUnavailableError(f"cannot list the models of the Triton server at {url}: "
                                      f"{' '.join(str(e).split()) or type(e).__name__}") from e
    finally:
        with contextlib.suppress(Exception):
            await client.close()


class TritonBackend(RemoteBackend):
    """MODEL on the Triton server `client.triton_url`; `info` from the model's config, explain via its explain
    model. Each call waits at most `client.triton_timeout_s`, start-up `client.triton_startup_timeout_s`;
    max_queue: how many requests the gateway lets be outstanding (the size of the connection pool); trace: pass
    the trace context on (`vit_serve.runtime.trace_context`)."""

    name = "triton"

    def __init__(self, model: str, client: TritonClientSettings, *, max_queue: int = 256,
                 trace: bool = False) -> None:
        self.model = model
        self.url = client.triton_url
        self.protocol, self.address = parse_url(self.url)
        self.timeout_s = float(client.triton_timeout_s)
        # The gateway lets at most max_queue requests be outstanding: each gets a connection at once.
        self.pool_size = int(max_queue) + SPARE_CONNECTIONS
        self.trace = trace
        if self.protocol == "http":
            import tritonclient.http.aio as client_module
        else:
            import tritonclient.grpc.aio as client_module
        self._tc = client_module
        self._conn: _Connection | None = None
        self._ready = False
        self.info = _run_blocking(lambda: self._start(float(client.triton_startup_timeout_s)))
        self.explain_model: str | None = self.info.explain_model
        self.max_batch_size: int = self.info.max_batch_size
        self._ready = True  # the gateway warms up (`warmup`) before it reports ready

    # ---- connection ----------------------------------------------------------------------------------------

    def _new_client(self, pool_size: int = SPARE_CONNECTIONS) -> Any:
        if self.protocol == "http":
            # No session-wide timeout: every call gets its own deadline (`_guard`), which does not count the
            # wait for a pooled connection against the session or close it when it expires.
            return self._tc.InferenceServerClient(self.address, conn_limit=pool_size, conn_timeout=None)
        # One HTTP/2 channel multiplexes every call, so there is no pool to size. A private subchannel pool
        # (gRPC shares connections between channels by default, so a fresh channel would inherit a failed one's
        # reconnect backoff) and a short backoff: after a server restart the connection comes back within a second.
        return self._tc.InferenceServerClient(self.address, channel_args=[
            *GRPC_MESSAGE_LIMITS, ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000)])

    def _shared(self) -> _Connection:
        """The running event loop's connection (aiohttp sessions and gRPC channels belong to one loop)."""
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is None or conn.loop is not loop or conn.retired:
            if conn is not None and conn.loop is not loop:
                self._retire(conn)
            conn = self._conn = _Connection(self._new_client(self.pool_size), loop)
        return conn

    def _retire(self, conn: _Connection) -> None:
        """Take `conn` out of use for new calls; it closes once the calls still on it have finished."""
        conn.retired = True
        if conn is self._conn:
            self._conn = None
        if conn.calls == 0:
            _close_soon(conn)

    def _unavailable(self, err: BaseException, what: str) -> BackendUnavailableError:
        self._mark(False, f"{what}: {err}")
        return BackendUnavailableError(f"Triton at {self.url} is unavailable ({what}): {err}")

    def _timed_out(self, what: str, timeout_s: float) -> ModelTimeoutError:
        return ModelTimeoutError(f"Triton did not answer {what} within {timeout_s:g} s (VIT_SERVE_TRITON_TIMEOUT_S)")

    def _mark(self, ready: bool, why: str = "") -> None:
        if ready != self._ready:
            log.log(logging.INFO if ready else logging.WARNING, "triton backend %s -> %s%s", self.url,
                    "ready" if ready else "unavailable", f" ({why})" if why else "")
        self._ready = ready

    def _call_kwargs(self, timeout_s: float) -> dict[str, Any]:
        # gRPC sends its deadline to the server; the HTTP client has no per-call timeout (`_guard` keeps it).
        return {"client_timeout": timeout_s} if self.protocol == "grpc" else {}

    def _trace_headers(self) -> dict[str, str] | None:
        """With tracing on, the current trace context (W3C traceparent / tracestate): HTTP headers or gRPC
        metadata, which Triton's OpenTelemetry tracing continues."""
        return context_headers() if self.trace else None

    async def _guard(self, conn: _Connection, what: str, coro: Any, timeout_s: float) -> Any:
        """Await one client call within `timeout_s`: past it ModelTimeoutError (504); connection failures and
        Triton's "not now" answers BackendUnavailableError (503); Triton's other errors RuntimeError.

        Only a gRPC channel whose connection failed is retired; a timeout or a failed HTTP call leaves the
        shared client to the others (aiohttp's pool discards a broken connection by itself).
        """
        import aiohttp
        from tritonclient.utils import InferenceServerException

        conn.calls += 1
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    return await coro
            except TimeoutError:
                raise self._timed_out(what, timeout_s) from None
            except InferenceServerException as e:
                status, msg = str(e.status() or ""), str(e.message() or "").lower()
                if status in TIMEOUT_STATUSES:
                    raise self._timed_out(what, timeout_s) from None
                if status in UNAVAILABLE_STATUSES or any(w in msg for w in UNAVAILABLE_WORDS):
                    if conn.shared and any(w in msg for w in CONNECTION_WORDS):  # not e.g. a full queue
                        self._retire(conn)
                    raise self._unavailable(e, what) from e
                raise RuntimeError(f"Triton {what} failed: {e}") from e
            except (OSError, aiohttp.ClientError) as e:  # refused, reset, disconnected mid-request, stale keep-alive
                raise self._unavailable(e, what) from e
        finally:
            conn.calls -= 1
            if conn.retired and conn.calls == 0:
                _close_soon(conn)

    # ---- start-up ------------------------------------------------------------------------------------------

    async def _start(self, wait_s: float) -> ModelInfo:
        """Wait up to `wait_s` for the server and the model(s) to be ready; read the config -> ModelInfo."""
        deadline = time.monotonic() + wait_s
        last: BaseException | None = None
        while True:
            try:
                return await self._describe()
            except (BackendUnavailableError, ModelTimeoutError) as e:
                last = e
            if time.monotonic() >= deadline:
                raise BackendUnavailableError(
                    f"Triton model {self.model!r} at {self.url} not ready after {wait_s:g}s: {last}")
            await asyncio.sleep(0.25)

    async def _describe(self) -> ModelInfo:
        async with self._private() as conn:
            await self._models_ready(conn, [self.model])
            raw = await self._guard(conn, "get_model_config",
                                    conn.client.get_model_config(self.model, **self._json_kwargs()), self.timeout_s)
            config = raw.get("config", raw)  # gRPC wraps it in {"config": ...}
            info = model_info(self.model, config, f"triton {self.url} model {self.model}")
            if info.explain_model:
                await self._models_ready(conn, [info.explain_model])
            return info

    @contextlib.asynccontextmanager
    async def _private(self) -> AsyncIterator[_Connection]:
        """A short-lived client of its own (sync calls, start-up: they run on their own event loop)."""
        conn = _Connection(self._new_client(), asyncio.get_running_loop(), shared=False)
        try:
            yield conn
        finally:
            with contextlib.suppress(Exception):
                await conn.client.close()

    def _json_kwargs(self) -> dict[str, Any]:
        return {"as_json": True, "client_timeout": self.timeout_s} if self.protocol == "grpc" else {}

    async def _models_ready(self, conn: _Connection, models: list[str], timeout_s: float | None = None) -> None:
        wait = timeout_s or self.timeout_s
        kw = self._call_kwargs(wait)
        if not await self._guard(conn, "is_server_ready", conn.client.is_server_ready(**kw), wait):
            raise self._unavailable(RuntimeError("server not ready"), "is_server_ready")
        for m in models:
            if not await self._guard(conn, "is_model_ready", conn.client.is_model_ready(m, **kw), wait):
                raise self._unavailable(RuntimeError(f"model {m!r} not ready"), "is_model_ready")

    async def warmup(self) -> None:
        """One batch through the logits model and the explain model (loads the ONNX sessions server-side)."""
        x = self._warmup_input()
        conn = self._shared()
        await self._infer(conn, self.model, x, [LOGITS])
        if self.explain_model:
            await self._infer(conn, self.explain_model, x, [LOGITS, ROLLOUT])

    # ---- inference -----------------------------------------------------------------------------------------

    async def _infer(self, conn: _Connection, model: str, x: np.ndarray, outputs: list[str],
                     options: CallOptions = NO_OPTIONS) -> list[np.ndarray]:
        """x [B, 3, H, W] -> the named outputs; batches over the model's max_batch_size are split. `options`:
        the request's deadline goes as Triton's `timeout` parameter (µs; the model's queue policy decides
        whether it may shorten its own) and, over gRPC, as the call's deadline; its level as `priority`."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 4 or x.shape[1:] != (3, *self.info.resolution):
            raise ValueError(f"expected a batch [B, 3, {self.info.resolution[0]}, {self.info.resolution[1]}], "
                             f"got {list(x.shape)}")
        step = self.max_batch_size or len(x)
        if len(x) > step:
            parts = await asyncio.gather(*(self._infer(conn, model, x[i:i + step], outputs, options)
                                           for i in range(0, len(x), step)))
            return [np.concatenate([p[j] for p in parts]) for j in range(len(outputs))]
        binary = {"binary_data": True} if self.protocol == "http" else {}
        inp = self._tc.InferInput(PIXEL_VALUES, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, **binary)
        requested = [self._tc.InferRequestedOutput(n, **binary) for n in outputs]
        wait = self.timeout_s if options.timeout_s is None else max(1e-3, min(self.timeout_s, options.timeout_s))
        schedule = {"priority": options.priority}
        if options.timeout_s is not None:
            schedule["timeout"] = max(1, int(wait * 1e6))
        result = await self._guard(conn, f"infer {model}", conn.client.infer(
            model, [inp], outputs=requested, headers=self._trace_headers(), **schedule,
            **self._call_kwargs(wait)), wait)
        self._mark(True)
        return [result.as_numpy(n) for n in outputs]

    async def run(self, task: Task, x: np.ndarray, options: CallOptions = NO_OPTIONS) -> Outputs:
        """x [B, 3, H, W] float32 -> logits [B, K] (classify), logits + rollout [B, gh, gw] (explain, from the
        explain model, whose rollout settings the task was resolved against) or logits + embedding [B, D] (embed):
        one Triton request with the request's deadline and level (`options`), the server batches."""
        if task.kind == "classify":
            (logits,) = await self._infer(self._shared(), self.model, x, [LOGITS], options)
            return {"logits": logits}
        if task.kind == "explain":
            if not self.explain_model:
                raise NotImplementedError(f"Triton model {self.model!r} has no explain model")
            logits, rollout = await self._infer(self._shared(), self.explain_model, x, [LOGITS, ROLLOUT], options)
            return {"logits": logits, "rollout": rollout}
        if task.kind == "embed":
            if not self.info.embedding_dim:
                raise NotImplementedError(f"Triton model {self.model!r} has no {EMBEDDING!r} output (re-export "
                                          f"with vit-export --outputs logits,embedding)")
            logits, embedding = await self._infer(self._shared(), self.model, x, [LOGITS, EMBEDDING], options)
            return {"logits": logits, "embedding": embedding}
        raise NotImplementedError(f"grad_rollout needs the torch backend; {self.model!r} runs on Triton")

    # ---- health --------------------------------------------------------------------------------------------

    async def ready(self) -> bool:
        """Probe the server now (server ready, logits and explain model ready) on the running event loop's
        connection; at most ~2 s."""
        return await self._probe(self._shared())

    async def _probe(self, conn: _Connection) -> bool:
        models = [self.model] + ([self.explain_model] if self.explain_model else [])
        wait = min(self.timeout_s, PROBE_TIMEOUT_S)
        try:
            async with asyncio.timeout(wait):  # the whole probe, not only each call
                await self._models_ready(conn, models, timeout_s=wait)
        except BackendUnavailableError:
            return False
        except (ModelTimeoutError, TimeoutError):  # a busy server is not a broken connection: nothing is dropped
            self._mark(False, f"no answer within {wait:g}s")
            return False
        self._mark(True)
        return True

    async def close(self) -> None:
        """Close the running event loop's client."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.retired = True
            with contextlib.suppress(Exception):
                await conn.client.close()
