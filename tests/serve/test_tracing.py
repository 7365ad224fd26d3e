"""OpenTelemetry tracing (vit_serve.serve.tracing) against real parts: the OpenTelemetry SDK's OTLP/HTTP exporter
posting to a real HTTP receiver that decodes what arrives with `opentelemetry.proto` (the OTLP spec's own
messages), the gateway under a real uvicorn, and a real tritonserver (nvidia-pytriton's) whose own OpenTelemetry
tracing (`--trace-config mode=opentelemetry`, Triton's C++ exporter) continues the trace the gateway passes on.

The caller's `traceparent` is made here by hand from the W3C Trace Context format, so the ids checked are ones
nobody on the serving side chose.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_helpers import live_app, live_server, settings_for
from http_stub import HttpStub, StubRequest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.instrumentation.fastapi")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
json_format = pytest.importorskip("google.protobuf.json_format")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

ROOT = Path(__file__).resolve().parents[2]
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
IDS = ("traceId", "spanId", "parentSpanId")


class OtlpReceiver:
    """A collector's OTLP/HTTP traces endpoint (POST /v1/traces) on a local HTTP stub (tests/http_stub.py).
    Protobuf bodies (the Python SDK's exporter) and JSON bodies (Triton's C++ exporter; OTLP/JSON writes ids as
    hex, not proto3's base64) are both decoded into ExportTraceServiceRequest. `spans`: (service.name, Span) of
    everything received."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.posts: list[tuple[str, str]] = []  # (path, content type)
        self._lock = threading.Lock()
        self._stub = HttpStub(self._receive)
        self.url = self._stub.url

    def _receive(self, request: StubRequest) -> tuple[int, str, bytes]:
        kind = request.headers.get("Content-Type", "")
        self._add(request.path, kind, request.body)
        return 200, kind, b""

    def _add(self, path: str, kind: str, body: bytes) -> None:
        request = trace_service.ExportTraceServiceRequest()
        if kind.startswith("application/json"):
            json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
        else:
            request.ParseFromString(body)
        with self._lock:
            self.posts.append((path, kind))
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                self.spans.extend((service, s) for ss in rs.scope_spans for s in ss.spans)

    def wait_for(self, found: Callable[[list[tuple[str, object]]], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if found(list(self.spans)):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"not received within {timeout:g}s; got {self.summary()}")
            time.sleep(0.05)

    def of_trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self._lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]

    def summary(self) -> list[tuple[str, str, str, str, str]]:
        with self._lock:
            return [(svc, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex()) for svc, s in self.spans]

    def close(self) -> None:
        self._stub.close()


def _hex_ids_to_base64(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: base64.b64encode(bytes.fromhex(v)).decode() if k in IDS and isinstance(v, str) else
                _hex_ids_to_base64(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hex_ids_to_base64(v) for v in obj]
    return obj


def _attributes(span: object) -> dict[str, object]:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


def _traceparent() -> tuple[str, str, str]:
    """A caller's W3C traceparent (version 00, sampled) and its trace and span ids, hex."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture
def receiver(monkeypatch) -> Iterator[OtlpReceiver]:
    """The receiver, and the OTEL_* variables that point the gateway's SDK at it (set before create_app)."""
    r = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)  # the SDK appends /v1/traces
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after each span ends
    for var in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED",
                "OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", "OTEL_PYTHON_EXCLUDED_URLS", "OTEL_PROPAGATORS"):
        monkeypatch.delenv(var, raising=False)
    yield r
    r.close()


def _post_image(url: str, photos: dict[str, bytes], headers: dict[str, str]) -> httpx.Response:
    r = httpx.post(f"{url}/classify", files={"file": ("coffee.jpg", photos["coffee.jpg"], "image/jpeg")},
                   headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


# ---- the gateway's own spans ---------------------------------------------------------------------------------


def test_request_span_continues_the_callers_trace(receiver, tiny_onnx, photos):
    """POST /classify with a traceparent: the server span the SDK exports over OTLP/HTTP protobuf is in the
    caller's trace, the caller's span is its parent, and it names the route. Without a traceparent: a new
    trace. /healthz: no span. Service name: "vit-serve" (no OTEL_SERVICE_NAME)."""
    header, trace_id, parent = _traceparent()
    with live_server(settings_for(tiny_onnx, otel=True)) as url:
        _post_image(url, photos, {"traceparent": header})
        _post_image(url, photos, {})
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        receiver.wait_for(lambda spans: sum(s.kind == SERVER for _, s in spans) >= 2)
    # The lifespan's end flushed the provider: everything it made is here now.
    servers = [(svc, s) for svc, s in receiver.spans if s.kind == SERVER]
    assert {p for p, _ in receiver.posts} == {"/v1/traces"}
    assert {k for _, k in receiver.posts} == {"application/x-protobuf"}
    assert len(servers) == 2, receiver.summary()  # the two classifications; the probe is not traced
    (svc, ours), (_, fresh) = sorted(servers, key=lambda p: p[1].trace_id.hex() != trace_id)
    assert svc == "vit-serve"
    assert (ours.trace_id.hex(), ours.parent_span_id.hex()) == (trace_id, parent)
    assert ours.span_id.hex() not in (parent, "0" * 16)
    assert ours.name == "POST /classify"
    attrs = _attributes(ours)
    assert attrs["http.route"] == "/classify"
    assert attrs.get("http.response.status_code", attrs.get("http.status_code")) == 200
    assert fresh.trace_id.hex() != trace_id and fresh.parent_span_id == b""  # a root span of its own trace


def test_grpc_calls_continue_the_callers_trace(receiver, tiny_onnx, photos):
    """tritonclient.grpc's ModelInfer with a traceparent in its metadata: a SERVER span named after the RPC, in the
    caller's trace with the caller's span as parent, OpenTelemetry's rpc.* attributes and status code 0; a failed
    call (unknown model) records its status code; the health RPCs are not traced."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    header, trace_id, parent = _traceparent()
    with live_app(settings_for(tiny_onnx, otel=True, grpc_port=0)) as (_, app):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{app.state.grpc.port}")
        assert client.is_server_live(headers={"traceparent": header})
        image = grpcclient.InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([photos["coffee.jpg"]], dtype=object))
        client.infer("tiny", [image], headers={"traceparent": header})
        with pytest.raises(InferenceServerException):
            client.infer("absent", [image], headers={"traceparent": header})
        client.close()
        receiver.wait_for(lambda spans: sum(s.kind == SERVER for _, s in spans) >= 2)
    grpc_spans = [s for _, s in receiver.spans if s.kind == SERVER and s.name.startswith("inference.")]
    assert sorted(s.name for s in grpc_spans) == ["inference.GRPCInferenceService/ModelInfer"] * 2, \
        receiver.summary()
    for span in grpc_spans:
        assert (span.trace_id.hex(), span.parent_span_id.hex()) == (trace_id, parent)
        attrs = _attributes(span)
        assert (attrs["rpc.system"], attrs["rpc.method"]) == ("grpc", "ModelInfer")
    assert sorted(_attributes(s)["rpc.grpc.status_code"] for s in grpc_spans) == [0, 5]  # OK, NOT_FOUND


OFF_SCRIPT = """
import asyncio, sys

def otel():
    return {m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")}

import fastapi  # recent FastAPI releases import the OpenTelemetry API themselves (a dependency of theirs)
framework = otel()
import httpx
from vit_serve.serve.app import create_app
from vit_serve.runtime.backends import triton  # the backend that passes the context on, imported too
from vit_serve.serve.settings import ServeSettings

async def main():
    app = create_app(ServeSettings(model=sys.argv[1], device="cpu", threads=1, decode_workers=2))
    async with app.router.lifespan_context(app):
        await app.state.gateway.wait_ready(60)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as c:
            r = await c.post("/classify", content=open(sys.argv[2], "rb").read(),
                             headers={"Content-Type": "image/jpeg", "traceparent": sys.argv[3]})
            assert r.status_code == 200, r.text

asyncio.run(main())
print(sorted(otel() - framework), sorted(m for m in otel() if m.startswith(NOT_WHEN_OFF)))
"""
NOT_WHEN_OFF = ("opentelemetry.sdk", "opentelemetry.instrumentation", "opentelemetry.exporter", "opentelemetry.proto")


def test_off_imports_nothing_of_opentelemetry(tiny_onnx, photos, tmp_path):
    """The default (otel off): creating the app, starting it and classifying an image with a traceparent adds no
    opentelemetry module to what `import fastapi` alone imports (FastAPI 0.165 imports the OpenTelemetry API
    itself), and none of the SDK, instrumentation or exporter (checked in a fresh interpreter)."""
    image = tmp_path / "coffee.jpg"
    image.write_bytes(photos["coffee.jpg"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIT_SERVE_")}
    script = OFF_SCRIPT.replace("NOT_WHEN_OFF", repr(NOT_WHEN_OFF))
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_onnx), str(image), _traceparent()[0]],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[] []"


# Runs the CLI with what the otel extra installs unimportable (the SDK, the FastAPI instrumentation, the OTLP
# exporter), as on an install without it; the OpenTelemetry API stays, as FastAPI itself may need it.
WITHOUT_OTEL = """
import importlib.abc, sys

EXTRA = ("opentelemetry.sdk", "opentelemetry.instrumentation", "opentelemetry.exporter")

class WithoutTheExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in EXTRA or name.startswith(tuple(f"{m}." for m in EXTRA)):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, WithoutTheExtra())
from vit_serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("extra_env", "blocked", "words"), [
    ({}, True, "pip install 'vit-serve[otel]'"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, False, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, False, "OTEL_TRACES_EXPORTER=zipkin"),
], ids=["extra-missing", "otlp-grpc", "unknown-exporter"])
def test_cli_refuses_tracing_it_cannot_do_in_one_line(tiny_onnx, extra_env, blocked, words):
    """`VIT_SERVE_OTEL=1 vit-serve serve MODEL` without the extra (or with an OTEL_* setting it cannot honour):
    exit code 1 and one line on stderr that says what to do; no traceback, no server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIT_SERVE_", "OTEL_"))}
    env.update({"VIT_SERVE_OTEL": "1", "VIT_SERVE_PORT": "0", "VIT_SERVE_THREADS": "1", **extra_env})
    argv = ["-c", WITHOUT_OTEL] if blocked else ["-m", "vit_serve"]
    proc = subprocess.run([sys.executable, *argv, "serve", str(tiny_onnx)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("vit-serve serve: error: "), proc.stderr
    assert words in lines[0] and "Traceback" not in proc.stderr


# ---- the trace passed on to Triton -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_repo(tiny_ckpt, tmp_path_factory) -> Path:
    import vit_export

    pytest.importorskip("tritonclient.http.aio")
    pytest.importorskip("tritonclient.grpc.aio")
    d = tmp_path_factory.mktemp("tracing_triton")
    options = vit_export.ExportOptions(formats=("onnx", "triton"), out=d / "exports", repo=d / "repo", name="tiny")
    assert vit_export.export(tiny_ckpt, options).ok
    return d / "repo"


@pytest.fixture(scope="module")
def traced_triton(triton_repo) -> Iterator[tuple[object, OtlpReceiver]]:
    """A real tritonserver tracing every request with OpenTelemetry (Triton's C++ exporter, OTLP/HTTP) into a
    receiver of its own: rate 1, level TIMESTAMPS, a 50 ms batch delay."""
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    r = OtlpReceiver()
    srv = TritonServer(triton_repo, models=["tiny_py", "tiny_explain_py"], extra_args=(
        "--trace-config", "mode=opentelemetry", "--trace-config", "rate=1", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", f"opentelemetry,url={r.url}/v1/traces",
        "--trace-config", "opentelemetry,bsp_schedule_delay=50",
        "--trace-config", "opentelemetry,resource=service.name=triton"))
    try:
        srv.start(timeout=120)
        yield srv, r
    finally:
        srv.close()
        r.close()


# Triton 2.51 (nvidia-pytriton 0.7.0) continues every traced HTTP request's context; over gRPC it starts a new
# root trace for some requests although their metadata carries the traceparent (measured: 1 to 2 in 12 direct
# tritonclient.grpc.aio calls, the gateway out of the loop). So over gRPC several requests are sent, and each
# span Triton did continue must hang under the right gateway span.
SENT = {"http": 1, "grpc": 6}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_trace_context_reaches_triton(receiver, traced_triton, photos, protocol, monkeypatch):
    """Caller -> gateway (OTEL_SERVICE_NAME=gateway) -> Triton over HTTP headers or gRPC metadata: Triton's own
    spans (exported by Triton's C++ SDK) are in the caller's trace, its InferRequest span a child of the gateway's
    server span, and its model span ("tiny_py") a child of that. HTTP: every request; gRPC: at least one of six
    and no span under a wrong parent (see SENT)."""
    server, triton_receiver = traced_triton
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway")
    url = server.http_url if protocol == "http" else f"grpc://{server.grpc_url}"
    callers = [_traceparent() for _ in range(SENT[protocol])]
    traces = {trace_id for _, trace_id, _ in callers}
    settings = settings_for("tiny_py", backend="triton", triton_url=url, otel=True)
    with live_server(settings) as gateway:
        for header, _, _ in callers:
            last_sent = time.time_ns()  # Triton runs on this machine's clock
            _post_image(gateway, photos, {"traceparent": header})
        receiver.wait_for(lambda spans: {s.trace_id.hex() for _, s in spans} >= traces)
        # The last request's spans, whatever their trace: every earlier span ended, and was exported, before them.
        triton_receiver.wait_for(lambda spans: any(s.name == "InferRequest" and s.start_time_unix_nano >= last_sent
                                                   for _, s in spans))
    continued = 0
    for _, trace_id, parent in callers:
        ((svc, ours),) = receiver.of_trace(trace_id)
        assert (svc, ours.kind, ours.name, ours.parent_span_id.hex()) == ("gateway", SERVER, "POST /classify",
                                                                         parent)
        theirs = {s.name: (svc, s) for svc, s in triton_receiver.of_trace(trace_id)}
        if protocol == "grpc" and not theirs:
            continue
        request_svc, request = theirs["InferRequest"]
        assert request_svc == "triton"
        assert request.parent_span_id == ours.span_id  # Triton continued the context the gateway sent
        assert theirs["tiny_py"][1].parent_span_id == request.span_id
        assert _attributes(theirs["tiny_py"][1]).get("triton.model_name") == "tiny_py"
        continued += 1
    # No Triton span hangs under a span of the gateway other than its request's own.
    gateway_spans = {s.span_id for _, s in receiver.spans}
    for _, s in triton_receiver.spans:
        if s.name == "InferRequest" and s.parent_span_id in gateway_spans:
            assert s.trace_id.hex() in traces
    assert continued == len(callers) if protocol == "http" else continued >= 1, (continued, len(callers))
