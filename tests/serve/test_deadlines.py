"""Deadlines, with real clients against the gateway under a real uvicorn (gRPC port on): httpx with
`X-Request-Timeout-Ms` and `?timeout_ms=` on /classify, /embed and /explain; tritonclient.http `infer(timeout=µs)`
(/v2 `parameters.timeout`, Triton's microseconds, 0: none); tritonclient.grpc `client_timeout=` (the call's
deadline) and `timeout=` (the parameter). A request whose deadline passes while it waits behind the held model
thread (`held_model.Gate`) is answered 504 / DEADLINE_EXCEEDED and is not run once the gate opens; a deadline
already past on arrival (1 ms for a 12 MP JPEG: reading and decoding it take longer) is refused before the model;
bad values are 422 / INVALID_ARGUMENT with a message. What the model ran: the batch_size histogram's sum in
/metrics (a batch is counted as it starts); refusals: `vit_serve_rejected_total{reason="deadline"}`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from held_model import Counts, Live, hold, live_held, until

grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

JPEG = {"Content-Type": "image/jpeg"}
ROUTES = ("/classify", "/embed", "/explain?format=json")


@pytest.fixture(scope="module")
def live(tiny_ckpt) -> Iterator[Live]:
    yield from live_held(tiny_ckpt)


def _url(base: str, route: str, **query: Any) -> str:
    extra = "&".join(f"{k}={v}" for k, v in query.items())
    return f"{base}{route}{('&' if '?' in route else '?') + extra if extra else ''}"


def _logits_request(module, live: Live, seed: int, **binary: bool) -> dict[str, Any]:
    """tritonclient's inputs and outputs for one pixel tensor, logits only (one classify pass)."""
    h, w = live.mv.info.resolution
    inp = module.InferInput("pixel_values", [1, 3, h, w], "FP32")
    inp.set_data_from_numpy(np.random.default_rng(seed).standard_normal((1, 3, h, w)).astype(np.float32), **binary)
    return {"inputs": [inp], "outputs": [module.InferRequestedOutput("logits", **binary)]}


def test_http_deadlines_pass_while_queued(live, photos):
    """httpx: on each route one request with X-Request-Timeout-Ms: 300 and one with ?timeout_ms=300 wait behind
    the held model and are answered 504 at their deadline; a request without one, queued among them, is run."""
    image = photos["coffee.jpg"]

    async def scenario():
        before = await Counts.of(live.url)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate, keeper = await hold(live, client, image)
            timed = []
            for route in ROUTES:
                timed.append(asyncio.create_task(client.post(_url(live.url, route), content=image,
                                                             headers={**JPEG, "X-Request-Timeout-Ms": "300"})))
                timed.append(asyncio.create_task(client.post(_url(live.url, route, timeout_ms=300), content=image,
                                                             headers=JPEG)))
            patient = asyncio.create_task(client.post(f"{live.url}/embed", content=image, headers=JPEG))
            refused = await asyncio.gather(*timed)
            assert live.mv.runner.depth == 1  # the patient one still waits
            late = await Counts.of(live.url)
            gate.open()
            answered = [await keeper, await patient]
        return before, refused, late, answered, await Counts.of(live.url)

    before, refused, late, answered, after = asyncio.run(scenario())
    for r in refused:
        assert r.status_code == 504, r.text
        assert "deadline has passed" in r.json()["detail"] and "not run" in r.json()["detail"]
    assert [r.status_code for r in answered] == [200, 200]
    assert late.since(before) == {"rows": 1, "deadline": 6, "cancelled": 0}
    assert after.since(before) == {"rows": 2, "deadline": 6, "cancelled": 0}


@pytest.mark.parametrize("route", ROUTES)
def test_http_deadline_past_on_arrival(live, phone_jpeg, route):
    """httpx: timeout_ms=1 (and the header) for a 12 MP JPEG: past before the model is reached; 504, nothing
    run."""

    async def scenario():
        before = await Counts.of(live.url)
        async with httpx.AsyncClient(timeout=60) as client:
            answers = [await client.post(_url(live.url, route, timeout_ms=1), content=phone_jpeg, headers=JPEG),
                       await client.post(_url(live.url, route), content=phone_jpeg,
                                         headers={**JPEG, "X-Request-Timeout-Ms": "1"})]
        return before, answers, await Counts.of(live.url)

    before, answers, after = asyncio.run(scenario())
    for r in answers:
        assert r.status_code == 504, r.text
        assert "deadline has passed" in r.json()["detail"]
    assert after.since(before) == {"rows": 0, "deadline": 2, "cancelled": 0}


def test_http_deadline_the_work_ahead_cannot_meet_is_refused_before_the_body(live, photos):
    """A raw HTTP/1.1 client sends the headers of a /classify upload with ?timeout_ms=300 and none of its body,
    while the held model has three requests queued and a run time of 0.2 s an image: 504 comes back at once,
    naming the work ahead, so the body was never waited for; nothing of it runs once the gate opens."""
    image = photos["coffee.jpg"]
    host, port = live.url.removeprefix("http://").split(":")

    async def scenario():
        before = await Counts.of(live.url)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate, keeper = await hold(live, client, image)
            cost = live.mv.runner.cost
            saved = cost.row_s("classify")
            cost.seed("classify", 0.2)
            try:
                patient = [asyncio.create_task(client.post(f"{live.url}/classify", content=image, headers=JPEG))
                           for _ in range(3)]
                await until(lambda: live.mv.runner.depth == 3)
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"POST /classify?timeout_ms=300 HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                             f"image/jpeg\r\nContent-Length: {len(image)}\r\n\r\n".encode())
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(next(ln.split(":")[1] for ln in head.decode().split("\r\n")
                                  if ln.lower().startswith("content-length")))
                refused = (head, await reader.readexactly(length))
                writer.close()
                late = await Counts.of(live.url)
            finally:
                gate.open()
                if saved is None:
                    cost.forget("classify")
                else:
                    cost.seed("classify", saved)
            answered = [await keeper, *await asyncio.gather(*patient)]
        return before, refused, late, answered, await Counts.of(live.url)

    before, (head, body), late, answered, after = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 504"), head
    assert b"the batches ahead of it need about" in body and b"not run" in body
    assert [r.status_code for r in answered] == [200] * 4
    assert late.since(before) == {"rows": 1, "deadline": 1, "cancelled": 0}
    assert after.since(before) == {"rows": 4, "deadline": 1, "cancelled": 0}


@pytest.mark.parametrize("route", ROUTES)
def test_http_zero_timeout_is_no_deadline(live, photos, route):
    """httpx: timeout_ms=0 and X-Request-Timeout-Ms: 0 (the schema's minimum) mean no deadline, as Triton's timeout
    0: each is answered 200, none refused for its deadline."""

    async def scenario():
        before = await Counts.of(live.url)
        async with httpx.AsyncClient(timeout=60) as client:
            answers = [await client.post(_url(live.url, route, timeout_ms=0), content=photos["coffee.jpg"],
                                         headers=JPEG),
                       await client.post(_url(live.url, route), content=photos["coffee.jpg"],
                                         headers={**JPEG, "X-Request-Timeout-Ms": "0"}),
                       await client.post(_url(live.url, route, timeout_ms="0.0"), content=photos["coffee.jpg"],
                                         headers={**JPEG, "X-Request-Timeout-Ms": "0"})]
        return before, answers, await Counts.of(live.url)

    before, answers, after = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
    assert after.since(before) == {"rows": 3, "deadline": 0, "cancelled": 0}


@pytest.mark.parametrize("route", ROUTES[1:])  # /classify: test_priorities
@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf", "1e400"])
def test_http_bad_timeouts_are_422(live, photos, route, value):
    """httpx: a negative or non-numeric timeout_ms / X-Request-Timeout-Ms is 422 naming it."""
    with httpx.Client(timeout=30) as client:
        answers = [client.post(_url(live.url, route, timeout_ms=value), content=photos["coffee.jpg"], headers=JPEG),
                   client.post(_url(live.url, route), content=photos["coffee.jpg"],
                               headers={**JPEG, "X-Request-Timeout-Ms": value})]
    for r in answers:
        assert r.status_code == 422, r.text
        assert "timeout" in r.text.lower()


def test_v2_parameters_timeout_in_microseconds(live, photos):
    """tritonclient.http `infer(timeout=300000)` (parameters.timeout, µs) waits behind the held model and is
    refused at its deadline (504); `timeout=0` means none: it waits and is answered."""
    address = live.url.removeprefix("http://")

    def infer(timeout_us: int, seed: int) -> Any:
        client = httpclient.InferenceServerClient(address, network_timeout=60)
        try:
            return client.infer("tiny", timeout=timeout_us, **_logits_request(httpclient, live, seed,
                                                                              binary_data=True))
        except InferenceServerException as e:
            return e
        finally:
            client.close()

    async def scenario():
        before = await Counts.of(live.url)
        async with httpx.AsyncClient(timeout=60) as client:
            gate, keeper = await hold(live, client, photos["coffee.jpg"])
            unbounded = asyncio.create_task(asyncio.to_thread(infer, 0, 1))
            await until(lambda: live.mv.runner.depth == 1)
            refused = await asyncio.to_thread(infer, 300_000, 2)
            late = await Counts.of(live.url)
            gate.open()
            answered = await unbounded
            assert (await keeper).status_code == 200
        return before, refused, late, answered, await Counts.of(live.url)

    before, refused, late, answered, after = asyncio.run(scenario())
    assert isinstance(refused, InferenceServerException), refused
    assert str(refused.status()) == "504" and "deadline has passed" in refused.message()
    assert answered.as_numpy("logits").shape == (1, live.mv.info.num_classes)
    assert late.since(before) == {"rows": 1, "deadline": 1, "cancelled": 0}
    assert after.since(before) == {"rows": 2, "deadline": 1, "cancelled": 0}


@pytest.mark.parametrize("timeout", [-5, "soon", float("nan"), float("inf"), float("-inf")])
def test_v2_bad_parameters_timeout_is_422(live, photos, timeout):
    """httpx (the JSON body tritonclient would not send): parameters.timeout negative or not a number -> 422."""
    h, w = live.mv.info.resolution
    pixels = {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, h, w], "data": [0.0] * (3 * h * w)}
    body = {"inputs": [pixels], "parameters": {"timeout": timeout}}
    # NaN / inf as Python's json writes them (JSON has no such numbers; the gateway's parser reads them)
    r = httpx.post(f"{live.url}/v2/models/tiny/infer", content=json.dumps(body), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert "parameters.timeout" in r.text


def test_grpc_deadlines_pass_while_queued(live, photos):
    """tritonclient.grpc: a call with `client_timeout=0.3` (the call's deadline) and one with `timeout=300000`
    (parameters.timeout, µs) wait behind the held model: DEADLINE_EXCEEDED, not run; a call with neither, queued
    beside them, is answered."""

    async def scenario():
        before = await Counts.of(live.url)
        grpc = grpcclient.InferenceServerClient(live.grpc)

        def infer(seed: int, **deadline: Any) -> Any:
            try:
                return grpc.infer("tiny", **_logits_request(grpcclient, live, seed), **deadline)
            except InferenceServerException as e:
                return e

        try:
            async with httpx.AsyncClient(timeout=60) as client:
                gate, keeper = await hold(live, client, photos["coffee.jpg"])
                patient = asyncio.create_task(asyncio.to_thread(infer, 1))
                await until(lambda: live.mv.runner.depth == 1)
                refused = await asyncio.gather(asyncio.to_thread(infer, 2, client_timeout=0.3),
                                               asyncio.to_thread(infer, 3, timeout=300_000))
                await until(lambda: live.mv.runner.depth == 1)
                late = await Counts.of(live.url)
                gate.open()
                answered = await patient
                assert (await keeper).status_code == 200
        finally:
            grpc.close()
        return before, refused, late, answered, await Counts.of(live.url)

    before, refused, late, answered, after = asyncio.run(scenario())
    for e in refused:
        assert isinstance(e, InferenceServerException), e
        assert str(e.status()) == "StatusCode.DEADLINE_EXCEEDED", e
    assert answered.as_numpy("logits").shape == (1, live.mv.info.num_classes)
    # both refused by the gateway for their deadline (the call's own deadline too, not counted as a hang-up)
    assert late.since(before) == {"rows": 1, "deadline": 2, "cancelled": 0}
    assert after.since(before) == {"rows": 2, "deadline": 2, "cancelled": 0}


def test_grpc_deadline_past_on_arrival(live, phone_jpeg):
    """tritonclient.grpc: the 12 MP JPEG as BYTES with `timeout=1` µs: DEADLINE_EXCEEDED before the decode;
    with `client_timeout=0.05` s the call's deadline passes while it is read or decoded: DEADLINE_EXCEEDED; the
    model runs neither. A negative `timeout` is INVALID_ARGUMENT."""

    async def scenario():
        before = await Counts.of(live.url)
        grpc = grpcclient.InferenceServerClient(live.grpc, channel_args=[("grpc.max_send_message_length", 2**26)])
        inp = grpcclient.InferInput("image", [1], "BYTES")
        inp.set_data_from_numpy(np.array([phone_jpeg], dtype=np.object_))
        errors = []
        try:
            for deadline in ({"timeout": 1}, {"client_timeout": 0.05}, {"timeout": -1}):
                with pytest.raises(InferenceServerException) as e:
                    await asyncio.to_thread(grpc.infer, "tiny", [inp], **deadline)
                errors.append(e.value)
        finally:
            grpc.close()
        await asyncio.sleep(0.5)  # a decode begun for the cancelled call finishes (its answer is thrown away)
        return before, errors, await Counts.of(live.url)

    before, errors, after = asyncio.run(scenario())
    assert [str(e.status()).removeprefix("StatusCode.") for e in errors] == \
        ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT"]
    assert "deadline has passed" in errors[0].message()
    assert "parameters.timeout" in errors[2].message()
    # the 1 µs one is refused by the gateway (counted); the 50 ms call's deadline passes while its 5 MiB message
    # is on its way in, or while it is decoded: gRPC ends it before the handler starts (not counted), cancels
    # the handler (counted as cancelled, at decode), or the handler finds it past its deadline first (counted as
    # a deadline: seen on a fast machine); it never runs, and is counted at most once
    since = after.since(before)
    assert since["rows"] == 0 and since["deadline"] in (1, 2)
    assert since["cancelled"] == since.get("cancelled_decode", 0) <= 1
    assert since["deadline"] - 1 + since["cancelled"] <= 1
