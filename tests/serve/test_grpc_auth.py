"""gRPC checks the API key before it reads the message (a server interceptor on the invocation metadata), and
caps the calls in flight (`grpc_max_concurrent_calls`, grpcio's `maximum_concurrent_rpcs`), so that anonymous
callers cannot make the gateway receive and buffer large messages. Against a real gateway under uvicorn with its
gRPC port on, spoken to by tritonclient's gRPC client and by grpcio's own channel (for messages tritonclient
cannot send: one that is not a ModelInferRequest at all, one that never finishes arriving). Reference: the same
calls with the key, which reach the servicer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from gateway_helpers import live_app, settings_for

grpcclient = pytest.importorskip("tritonclient.grpc")
import grpc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

KEY = "grpc-key-5d1e"
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _code(c: grpcclient.InferenceServerClient, x: np.ndarray, **kw) -> tuple[str, str]:
    """(status code name, message) of one ModelInfer; ("OK", "") when it is answered."""
    try:
        c.infer("tiny", [_input(x)], **kw)
        return "OK", ""
    except InferenceServerException as e:
        return str(e.status()).removeprefix("StatusCode."), e.message() or ""


@pytest.fixture(scope="module")
def keyed(tiny_onnx) -> Iterator[str]:
    """A gateway with an API key and 1 MiB gRPC messages; its gRPC address."""
    with live_app(settings_for(tiny_onnx, grpc_port=0, api_keys=[KEY], grpc_max_message_bytes=2**20)) as (_, app):
        yield app.state.grpc.address


def test_an_anonymous_large_message_is_refused_unauthenticated_before_it_is_read(keyed):
    big = np.zeros((200, 3, 32, 48), np.float32)  # 3.7 MB: over the 1 MiB limit
    small = np.zeros((1, 3, 32, 48), np.float32)
    c = grpcclient.InferenceServerClient(keyed)
    try:
        anonymous_big = _code(c, big)
        anonymous_small = _code(c, small)
        wrong_key = _code(c, small, headers={"x-api-key": "nope"})
        keyed_big = _code(c, big, headers={"authorization": f"Bearer {KEY}"})
        keyed_small = _code(c, small, headers={"authorization": f"Bearer {KEY}"})
        live = c.is_server_live()  # the probes stay open
    finally:
        c.close()
    print(f"\nanonymous 3.7 MB: {anonymous_big}; keyed 3.7 MB: {keyed_big[0]}")
    assert anonymous_big[0] == "UNAUTHENTICATED" and "an API key is needed" in anonymous_big[1]
    assert anonymous_small[0] == "UNAUTHENTICATED" and wrong_key == ("UNAUTHENTICATED", "the API key is not valid")
    assert keyed_big[0] == "RESOURCE_EXHAUSTED"  # the key gets past the check; the message limit answers
    assert keyed_small == ("OK", "") and live


def test_an_anonymous_message_that_does_not_parse_is_unauthenticated(keyed):
    """Bytes that are no ModelInferRequest: refused for the missing key, not for the parse (the servicer's
    deserialiser never sees them)."""
    with grpc.insecure_channel(keyed) as channel:
        call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as anonymous:
            call(b"\xff\xff\xff\xff not a protobuf", timeout=30)
        with pytest.raises(grpc.RpcError) as keyed_call:
            call(b"\xff\xff\xff\xff not a protobuf", timeout=30, metadata=(("x-api-key", KEY),))
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED, anonymous.value.details()
    assert keyed_call.value.code() != grpc.StatusCode.UNAUTHENTICATED  # with the key it reaches the parser


def test_calls_beyond_the_cap_are_resource_exhausted(tiny_onnx):
    """Cap 1: while one call is held in flight (its message never finishes arriving), another is refused with
    RESOURCE_EXHAUSTED; once the first ends, calls are answered again."""
    release = threading.Event()
    x = np.zeros((1, 3, 32, 48), np.float32)
    request = pb.ModelInferRequest(model_name="tiny", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="pixel_values", datatype="FP32", shape=list(x.shape))], raw_input_contents=[x.tobytes()])

    def held() -> Iterator[pb.ModelInferRequest]:
        release.wait(60)
        yield request

    with live_app(settings_for(tiny_onnx, grpc_port=0, grpc_max_concurrent_calls=1)) as (_, app):
        address = app.state.grpc.address
        with grpc.insecure_channel(address) as channel:
            call = channel.stream_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            c = grpcclient.InferenceServerClient(address)
            try:
                # The held call is in flight once the server has taken it: until then a call may still pass. If
                # it reaches the server while one of those calls is in flight, the held call is the one refused:
                # hold another.
                deadline, second, refused = time.monotonic() + 30, ("OK", ""), 0
                first = call.future(held(), timeout=120)
                while second[0] == "OK" and time.monotonic() < deadline:
                    second = _code(c, x)
                    if second[0] == "OK" and first.done():
                        assert first.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, first.code()
                        refused += 1
                        first = call.future(held(), timeout=120)
                print(f"held calls refused while a probe was in flight: {refused}")
                release.set()
                answered = first.result(timeout=60)
                third = _code(c, x)
            finally:
                release.set()
                c.close()
    print(f"\nsecond call while one is in flight: {second}")
    assert second[0] == "RESOURCE_EXHAUSTED", second
    assert answered.outputs and third == ("OK", "")
