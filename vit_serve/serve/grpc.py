"""The Open Inference Protocol over gRPC: KServe v2's `inference.GRPCInferenceService`, beside HTTP.

The proto is the spec's own, as the stubs tritonclient ships (`tritonclient.grpc.service_pb2`). Served with
grpcio's asyncio server in the app's event loop (the app's lifespan starts it when `grpc_port` is set), so that
gRPC requests go through the same model versions and batchers as HTTP ones.

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer, RepositoryIndex,
RepositoryModelLoad and RepositoryModelUnload (the others answer UNIMPLEMENTED). ModelInfer takes one input,
`pixel_values` FP32 [B, 3, H, W] or `image` BYTES [B] (encoded images), as `raw_input_contents` or typed
`contents`; request parameters `head_fusion` / `discard_ratio` set the rollout; an output parameter
`classification = k` answers Triton's classification extension. Outputs are always `raw_output_contents`, as
Triton sends them. `model_version` "" is the newest version in service.

Errors carry the HTTP routes' messages, with the status mapped as Triton and KServe do (`vit_serve.serve.errors`:
one table for HTTP and gRPC); anything unexpected is logged and answers INTERNAL with one line, never a
traceback. Messages either way are limited to `grpc_max_message_bytes` (gRPC's own 4 MiB default is smaller than
a 12 MP JPEG: kserve#3717); a larger one answers RESOURCE_EXHAUSTED; so do calls beyond `grpc_max_concurrent_calls`
in flight. With API keys on, a call
sends one as metadata (`authorization: Bearer KEY` or `x-api-key: KEY`), checked by a server interceptor
(`KeyCheck`) from the call's metadata before its message is read: UNAUTHENTICATED without, whatever the message
(INVALID_ARGUMENT with more than one key; a presented sha256:HEX is not a key);
load / unload need an admin key (PERMISSION_DENIED), or, with no admin keys, `--allow-any-key-admin`. TLS uses
the HTTP server's certificate and key.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceServicer, add_GRPCInferenceServiceServicer_to_server

from vit_serve.runtime.errors import ServingError
from vit_serve.serve import pipeline, v2_model
from vit_serve.serve.admission import Admission, Caller
from vit_serve.serve.caller import ANYONE, Identity
from vit_serve.serve.deps import ModelChoice
from vit_serve.serve.errors import (
    BadRequestError,
    NotReadyError,
    RateLimitedError,
    client_message,
    grpc_code,
    grpc_status_code,
)
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.in_flight import RETRY_AFTER_S
from vit_serve.serve.labels import LabelCaller
from vit_serve.serve.metrics import GatewayMetrics
from vit_serve.serve.rate_limit import KeyCounts
from vit_serve.serve.security import (
    GRPC_ADMIN_METHODS,
    GRPC_PROBE_METHODS,
    KeyRing,
    TwoKeysError,
    count_refusal,
    presented_key,
)
from vit_serve.serve.tracing import grpc_server_span
from vit_serve.serve.v2_protocol import (
    DTYPES,
    InferRequest,
    OutputTensor,
    RequestBounds,
    Tensor,
    bytes_blob,
    check_output_parameters,
    check_spec,
    tensor_from_raw,
    tensor_from_values,
)

log = logging.getLogger("vit_serve.serve")

# Typed `contents` field of each datatype (FP16 has none: it travels raw).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}

# API keys (vit_serve.serve.security) come as metadata; the probes stay open with open_probes, as over HTTP.
PROBES = frozenset(GRPC_PROBE_METHODS)
ADMIN_RPCS = frozenset(GRPC_ADMIN_METHODS)
# The call's identity, as KeyCheck verified it (`caller.Identity`): set while its handler runs.
CALL_IDENTITY: contextvars.ContextVar[Identity] = contextvars.ContextVar("vit_serve_call_identity", default=ANYONE)

R = TypeVar("R")
Handler = Callable[..., Awaitable[R]]


def _answers_errors(rpc: Handler) -> Handler:
    """A servicer method whose runtime and gateway errors (a backend that does not answer too) end the call with
    their status code and message (serve.errors); anything else is logged and answers INTERNAL in one line. (Keys
    are checked before, by `KeyCheck`.)"""

    name = rpc.__name__

    @functools.wraps(rpc)
    async def wrapped(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tracer = None if name in PROBES else self.tracer  # probes are not traced (as over HTTP)
        with grpc_server_span(tracer, name, context.invocation_metadata()) as span:
            try:
                answer = await rpc(self, request, context)
                if span is not None:
                    span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
                return answer
            except ServingError as e:  # the runtime's and the gateway's errors: serve.errors' one table
                code, message, retry = grpc_code(e), client_message(e), e.retry_after
            except Exception as e:
                log.exception("gRPC %s failed", rpc.__name__)
                code, message, retry = grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})", None
            if span is not None:
                span.set_attribute("rpc.grpc.status_code", code.value[0])
        if retry is not None:
            context.set_trailing_metadata((("retry-after", str(retry)),))
        await context.abort(code, message)

    return wrapped


def parameter(p: pb.InferParameter | pb.ModelRepositoryParameter) -> Any:
    """The value a request parameter holds (None when unset)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _tensor(spec: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, bounds: RequestBounds) -> Tensor:
    name, datatype, shape = spec.name, spec.datatype, list(spec.shape)
    check_spec(name, datatype, shape)
    count = bounds.check(name, datatype, shape)  # before any data is converted or decoded
    if raw is not None:
        if spec.HasField("contents"):
            raise BadRequestError(f"input {name!r}: send raw_input_contents or contents, not both")
        return tensor_from_raw(name, datatype, shape, raw)
    field = CONTENTS.get(datatype)
    if field is None:
        raise BadRequestError(f"input {name!r}: {datatype} needs raw_input_contents"
                              if datatype in DTYPES else f"input {name!r}: unknown datatype {datatype!r}")
    contents = getattr(spec.contents, field)
    if len(contents) != count:
        what = "BYTES elements" if datatype == "BYTES" else "values"
        raise BadRequestError(f"input {name!r}: {len(contents)} {what} for shape {shape}")
    return tensor_from_values(name, datatype, shape, list(contents))


def infer_request(request: pb.ModelInferRequest, bounds: RequestBounds) -> InferRequest:
    """A ModelInferRequest -> the InferRequest the HTTP routes parse too; 400 on anything malformed or beyond
    `bounds`."""
    if not request.inputs:
        raise BadRequestError("an inference request needs at least one input")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequestError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs (one per input, "
                              f"in order, or none)")
    inputs: dict[str, Tensor] = {}
    for i, spec in enumerate(request.inputs):
        tensor = _tensor(spec, raw[i] if raw else None, bounds)
        inputs[tensor.name] = tensor
    outputs = None
    if request.outputs:
        outputs = []
        for o in request.outputs:
            out = {"name": o.name, "parameters": {k: parameter(v) for k, v in o.parameters.items()}}
            check_output_parameters(out)
            outputs.append(out)
    params = {k: parameter(v) for k, v in request.parameters.items()}
    return InferRequest(request.id or None, inputs, outputs, params)


def infer_response(model: str, version: str, request_id: str | None,
                   outputs: list[OutputTensor]) -> pb.ModelInferResponse:
    """The outputs as a ModelInferResponse, each as raw_output_contents."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id or "")
    for out in outputs:
        response.outputs.add(name=out.name, datatype=out.datatype, shape=list(out.shape))
        if out.datatype == "BYTES":
            response.raw_output_contents.append(bytes_blob(list(out.data)))
        else:
            response.raw_output_contents.append(np.ascontiguousarray(out.data, DTYPES[out.datatype]).tobytes())
    return response


async def _read(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """The call's message: read already (grpc.aio hands it whole)."""
    return request


async def _cancelled_with_the_call(admission: Admission, work: Awaitable[R], metrics: GatewayMetrics) -> R:
    """`work`'s answer. When grpc.aio cancels the call (the client cancelled, or its deadline passed), the request
    is marked as left (`Ticket.caller_left`) before its work is cancelled, as `hangup` does over HTTP: counted in
    `vit_serve_cancelled_total` here, or by the runner that holds it then (queued or running)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        metrics.caller_left(admission)
        task.cancel()
        await asyncio.wait([task])  # the work has left the queue (and its runner has counted it) when the call ends
        if not task.cancelled():
            task.exception()  # retrieved: a work that ended otherwise meanwhile is not logged as never retrieved
        raise


class Servicer(GRPCInferenceServiceServicer):
    """The RPCs, on one gateway (method names are the proto's)."""

    def __init__(self, gateway: Gateway, tracer: Any | None = None, ring: KeyRing | None = None) -> None:
        self.gateway, self.tracer = gateway, tracer
        self.ring = ring if ring is not None else KeyRing()  # the keys (KeyCheck has checked them): `caller`

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The call's Caller (its verified key's name and priority level, `KeyCheck`; anonymous without keys), for
        its Admission."""
        return CALL_IDENTITY.get().caller

    @_answers_errors
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    @_answers_errors
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:  # noqa: N802
        ok, _ = await self.gateway.readiness()
        return pb.ServerReadyResponse(ready=ok)

    @_answers_errors
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:  # noqa: N802
        """ready false while the model is loading or unloaded. A probe open to anyone (open_probes) tells an
        anonymous caller ready true or false and nothing else: a name or version the repository lacks is ready
        false too, so that it learns neither which models exist nor why one is not ready; a caller with a valid
        key (or anyone, with keys off) gets NOT_FOUND / INVALID_ARGUMENT for those, as ModelMetadata answers."""
        try:
            mv = self.gateway.model(request.name or None, request.version or None)
        except NotReadyError:
            return pb.ModelReadyResponse(ready=False)
        except ServingError:
            if self.ring.allows(metadata_key(context.invocation_metadata())):
                raise
            return pb.ModelReadyResponse(ready=False)
        ok, _ = await mv.readiness()
        return pb.ModelReadyResponse(ready=ok)

    @_answers_errors
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:  # noqa: N802
        return pb.ServerMetadataResponse(**v2_model.server_metadata())

    @_answers_errors
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:  # noqa: N802
        mv = self.gateway.model(request.name or None, request.version or None)
        meta = v2_model.model_metadata(mv, v2_model.versions(self.gateway, mv.name))
        meta.pop("parameters")  # the proto has no field for them: GET /v2/models/{name} has them
        return pb.ModelMetadataResponse(**meta)

    @_answers_errors
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:  # noqa: N802
        """Inference, as /v2 infer (the same pipeline call); the call's deadline and `timeout` / `priority`
        parameters are the request's (`admission`), and a call the client cancels (or whose deadline passes) leaves
        the queue."""
        admission = Admission(caller=self.caller(context))  # the key's name and level
        admission.within(context.time_remaining(), "the call's deadline")
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        choice = ModelChoice(self.gateway, request.model_name or None, request.model_version or None,
                             metadata.get("x-session-id"))
        source = pipeline.TensorRequest(functools.partial(_read, request), infer_request, self._label_caller)
        done = await _cancelled_with_the_call(admission, pipeline.answer_tensors(choice, admission, source),
                                              self.gateway.metrics)
        outputs = v2_model.output_tensors(done.request, done.wanted, done.answer)
        return infer_response(done.model, done.version, done.request.id, outputs)

    async def _label_caller(self) -> LabelCaller:
        """Whose label cache and rate a call's labels use: its verified key's."""
        return LabelCaller(CALL_IDENTITY.get().scope, self.ring.limits)

    @_answers_errors
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:  # noqa: N802
        """Every model version with its state (`ready`: only those in service); a model never loaded: its name."""
        response = pb.RepositoryIndexResponse()
        for row in v2_model.repository_of(self.gateway).index():
            if request.ready and row.state != "READY":
                continue
            response.models.add(name=row.name, version="" if row.version is None else str(row.version),
                                state=row.state or "", reason=row.reason or "")
        return response

    @_answers_errors
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,  # noqa: N802
                                  context: Any) -> pb.RepositoryModelLoadResponse:
        """Load (again) a model; needs --model-control explicit, as over HTTP."""
        await v2_model.repository_of(self.gateway).load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @_answers_errors
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,  # noqa: N802
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        await v2_model.repository_of(self.gateway).unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


def metadata_key(metadata: Any) -> str | None:
    """The key of a call's metadata (`authorization: Bearer KEY` or `x-api-key: KEY`; None without); more than
    one of them is a TwoKeysError (INVALID_ARGUMENT)."""
    return presented_key(metadata or ())


class KeyCheck(grpc.aio.ServerInterceptor):
    """API keys from the call's metadata, before its message is read: a call without the right key is answered
    by a handler that never reads the request (UNAUTHENTICATED, or PERMISSION_DENIED on load / unload), so that
    an anonymous caller's message is neither received whole nor parsed; so is a call with more than one key
    (INVALID_ARGUMENT) and a key over its rate (every RPC but the probes counts: RESOURCE_EXHAUSTED with
    `retry-after` and the `ratelimit-*` numbers as trailing metadata). The key is verified once: its
    `caller.Identity` is the handler's (`CALL_IDENTITY`), and a key with `max_concurrent_per_key` calls running
    is refused RESOURCE_EXHAUSTED. `counts`: the per-key counts (`rate_limit.KeyCounts`)."""

    def __init__(self, ring: KeyRing, counts: KeyCounts | None = None) -> None:
        self.ring, self.counts = ring, counts

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        name = details.method.rpartition("/")[2]
        admin, ring = name in ADMIN_RPCS, self.ring
        if not admin and (not ring.on or (ring.open_probes and name in PROBES)):
            return await continuation(details)
        ring.refresh()
        try:
            key = metadata_key(details.invocation_metadata)
        except TwoKeysError as e:
            return _refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        identity = ring.identify(key)
        if identity is None:
            return _refusal(grpc.StatusCode.UNAUTHENTICATED,
                            "an API key is needed: send metadata authorization: Bearer KEY or x-api-key: KEY"
                            if key is None else "the API key is not valid")
        if not ring.admits(identity, admin):
            return _refusal(grpc.StatusCode.PERMISSION_DENIED, ring.refusal())
        if not ring.on or name in PROBES:
            return self._as(identity, await continuation(details), counted=False)
        limit = ring.take(identity.scope)
        if self.counts is not None:
            self.counts.count(identity.name, limit is None or limit.allowed)
        if limit is None or limit.allowed:
            return self._as(identity, await continuation(details), counted=True)
        trailing = tuple((k.lower(), v) for k, v in limit.headers())
        return _refusal(grpc_status_code(RateLimitedError.status), limit.message(), trailing)

    def _as(self, identity: Identity, handler: Any, counted: bool) -> Any:
        """`handler` run as `identity` (`CALL_IDENTITY`), within its key's cap on calls in flight (`counted`)."""
        if handler is None or handler.unary_unary is None:
            return handler
        behavior, ring, counts = handler.unary_unary, self.ring, self.counts

        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if counted and not ring.in_flight.enter(identity.scope):
                count_refusal(counts, identity.name, "too_many_in_flight")
                context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
                await context.abort(grpc_status_code(RateLimitedError.status), ring.in_flight.message())
            token = CALL_IDENTITY.set(identity)
            try:
                return await behavior(request, context)
            finally:
                CALL_IDENTITY.reset(token)
                if counted:
                    ring.in_flight.leave(identity.scope)

        return handler._replace(unary_unary=run)


def _refusal(code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...] = ()) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` (and `trailing` metadata) without reading its message (a request
    stream left unread: no deserializer, nothing received beyond gRPC's flow-control window)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        if trailing:
            context.set_trailing_metadata(trailing)
        await context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(refuse)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """The gateway's gRPC server: `await start()` binds settings.host:grpc_port (0: a free port; `port` says which
    one; TLS with ssl_certfile / ssl_keyfile), `await stop()` lets the calls in flight finish (up to `grace`
    seconds)."""

    def __init__(self, gateway: Gateway, tracer_provider: Any | None = None, ring: KeyRing | None = None) -> None:
        self.gateway = gateway
        self.ring = ring  # the app's (its rate buckets shared with HTTP); None: from the settings at start
        # With tracing on (vit_serve.serve.tracing), each call is a span of the app's own provider.
        self.tracer = None if tracer_provider is None else tracer_provider.get_tracer("vit_serve.serve.grpc")
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return _address(self.gateway.settings.host, self.port if self.port is not None else 0)

    async def start(self) -> None:
        s = self.gateway.settings
        if s.grpc_port is None:
            raise ValueError("grpc_port is not set")
        limit = s.grpc_max_message_bytes
        ring, tls = self.ring or KeyRing.from_settings(s.security, s.repository.repository_api), s.security
        counts = KeyCounts.on(self.gateway.metrics.registry)
        server = grpc.aio.server(interceptors=[KeyCheck(ring, counts)],
                                 maximum_concurrent_rpcs=s.grpc_max_concurrent_calls,
                                 options=[("grpc.max_send_message_length", limit),
                                          ("grpc.max_receive_message_length", limit),
                                          ("grpc.so_reuseport", 0)])
        add_GRPCInferenceServiceServicer_to_server(Servicer(self.gateway, self.tracer, ring), server)
        address = _address(s.host, s.grpc_port)
        try:
            if tls.ssl_certfile and tls.ssl_keyfile:
                pair = (Path(tls.ssl_keyfile).read_bytes(), Path(tls.ssl_certfile).read_bytes())
                port = server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:  # grpcio raises when it cannot bind
            raise OSError(f"cannot serve gRPC on {address}: {e}") from None
        await server.start()
        self._server, self.port = server, port
        log.info("gRPC (Open Inference Protocol) on %s, messages up to %d bytes, %d calls at once", self.address,
                 limit, s.grpc_max_concurrent_calls)

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
