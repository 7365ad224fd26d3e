"""Property-based API testing of the whole gateway from its own OpenAPI document (schemathesis): no operation
answers 5xx, whatever the query, path, headers and body, including the image uploads.

The app runs in-process with its lifespan (schemathesis' ASGI transport starts it: the model is loaded and warmed
up) on the torch backend with a tiny random ViT. Generated bodies are mostly garbage, so a share of the upload
cases is given a real image (and GET /explain a known id) to reach the inference paths with generated parameters.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

import vit_serve

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the skip
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.python import asgi  # noqa: E402

EXAMPLES = 30  # per operation and mode; the hand-parsed inference protocol gets more
EXAMPLES_V2_INFER = 80


def _png(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# Real images for the upload routes: square, wide and tall (crop paths), and a greyscale JPEG.
IMAGES = [_png(0, (40, 40)), _png(1, (70, 30)), _png(2, (17, 53))]
_buf = io.BytesIO()
Image.fromarray(np.arange(48 * 48, dtype=np.uint8).reshape(48, 48) % 251, "L").save(_buf, format="JPEG")
IMAGES.append(_buf.getvalue())
KNOWN_ID = hashlib.sha256(IMAGES[0]).hexdigest()


MODEL_NAME = "tiny"
RES = 32


def _v2_bodies() -> st.SearchStrategy[dict]:
    """Open Inference Protocol requests for POST /v2/models/{name}/infer: valid ones (pixel_values [B, 3, 32, 32]
    with B up to past max_batch, base64-encoded images; valid outputs and rollout parameters), and noisy ones
    (odd parameters, unknown outputs, broken tensors)."""
    finite = st.floats(allow_nan=False, allow_infinity=False)
    pixels = st.integers(1, 20).flatmap(lambda b: st.fixed_dictionaries({
        "name": st.just("pixel_values"), "datatype": st.sampled_from(["FP32", "FP16", "FP64"]),
        "shape": st.just([b, 3, RES, RES]),
        "data": st.sampled_from([0.0, 1.5, -3.0, 1e30]).map(lambda v: [v] * (b * 3 * RES * RES))}))
    images = st.lists(st.sampled_from(IMAGES), min_size=1, max_size=4).map(lambda imgs: {
        "name": "image", "datatype": "BYTES", "shape": [len(imgs)],
        "data": [base64.b64encode(i).decode() for i in imgs]})
    output = st.fixed_dictionaries({"name": st.sampled_from(["logits", "rollout"])}, optional={
        "parameters": st.fixed_dictionaries({}, optional={"binary_data": st.booleans()})})
    valid = st.fixed_dictionaries({"inputs": st.one_of(pixels, images).map(lambda t: [t])}, optional={
        "outputs": st.lists(output, min_size=1, max_size=2, unique_by=lambda o: o["name"]),
        "parameters": st.fixed_dictionaries({}, optional={
            "binary_data_output": st.booleans(), "head_fusion": st.sampled_from(["mean", "max", "min"]),
            "discard_ratio": st.sampled_from([0.0, 0.5, 0.9, 0.999])}),
        "id": st.text(max_size=4)})

    broken = st.fixed_dictionaries({
        "name": st.sampled_from(["pixel_values", "image", "logits"]),
        "datatype": st.sampled_from(["FP32", "BYTES", "INT64", "UINT8", "BOOL", "nope"]),
        "shape": st.lists(st.one_of(st.integers(-2, 40), st.just(2**62), st.booleans()), max_size=5),
    }, optional={"data": st.one_of(st.lists(st.one_of(finite, st.integers(), st.text(max_size=4)), max_size=8),
                                   st.text(max_size=4), st.none(), st.lists(st.lists(finite, max_size=3))),
                 "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-1, 64)})})
    bad_image = st.just({"name": "image", "datatype": "BYTES", "shape": [1],
                         "data": [base64.b64encode(b"not an image").decode()]})
    noisy = st.fixed_dictionaries({
        "inputs": st.one_of(st.lists(broken, max_size=2), st.tuples(pixels, images).map(list),
                            bad_image.map(lambda t: [t]), st.one_of(pixels, images).map(lambda t: [t])),
    }, optional={
        "outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["logits", "rollout", "other"])}),
                            max_size=3),
        "parameters": st.fixed_dictionaries({}, optional={
            "head_fusion": st.one_of(st.sampled_from(["mean", "avg", ""]), st.integers(), st.none()),
            "discard_ratio": st.one_of(finite, st.integers(-2, 2), st.text(max_size=3), st.none())}),
        "id": st.one_of(st.integers(), st.none())})
    return st.one_of(valid, noisy)


@pytest.fixture(scope="module")
def app(tmp_path_factory, randomize):
    from vit_serve.serve.app import create_app
    from vit_serve.serve.settings import ServeSettings

    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=RES), seed=1)
    model.labels = [f"label {i}" for i in range(10)]
    ckpt = tmp_path_factory.mktemp("schemathesis") / f"{MODEL_NAME}.safetensors"
    vit_serve.save(model, ckpt)
    app = create_app(ServeSettings(model=str(ckpt), backend="torch", device="cpu", threads=1, decode_workers=1,
                                   max_queue=64, request_timeout_s=30))
    yield app
    asgi.shutdown_lifespans()  # the lifespan schemathesis started: the gateway stops, its threads end


@pytest.fixture(scope="module")
def api(app):
    """The app's OpenAPI schema; loading it starts the app's lifespan. Waits until /readyz says ready."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    with asgi.get_client(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not become ready within 60 s"
            time.sleep(0.05)
        # An image the store knows, for GET /explain?id=...
        r = client.post("/classify", files={"file": ("known.png", IMAGES[0], "image/png")})
        assert r.status_code == 200 and r.json()["id"] == KNOWN_ID

    @schema.hook
    def flatmap_body(context, body):
        """Half of the upload bodies carry a real image instead of generated bytes; half of the v2 JSON bodies
        are (near-)valid inference requests."""
        path = context.operation.path if context.operation else ""
        if path == "/v2/models/{name}/infer" and isinstance(body, dict):
            return st.one_of(_v2_bodies(), st.just(body))
        if path not in ("/classify", "/explain"):
            return st.just(body)
        if isinstance(body, dict) and "file" in body:
            real = st.sampled_from(IMAGES).map(lambda img: {**body, "file": img})
        elif isinstance(body, bytes | bytearray):
            real = st.sampled_from(IMAGES)
        else:
            return st.just(body)
        return st.one_of(st.just(body), real)

    @schema.hook
    def flatmap_query(context, query):
        """Two thirds of the GET /explain cases ask for an image the server has."""
        op = context.operation
        if op is None or (op.method.upper(), op.path) != ("GET", "/explain") or not isinstance(query, dict):
            return st.just(query)
        known = {**query, "id": KNOWN_ID}
        return st.one_of(st.just(known), st.just(known), st.just(query))

    @schema.hook
    def flatmap_path_parameters(context, params):
        """Two thirds of the /v2/models/{name}... cases name the served model (and its version, "1")."""
        if not isinstance(params, dict) or "name" not in params:
            return st.just(params)
        known = {**params, "name": MODEL_NAME, **({"version": "1"} if "version" in params else {})}
        return st.one_of(st.just(known), st.just(known), st.just(params))

    return schema


def _operations() -> list[tuple[str, str, str]]:
    """(METHOD, path, generation mode) of every operation in the spec (building the app loads nothing; only its
    lifespan does): `positive` for all, `negative` for those with parameters or a body (the others have no input
    that could violate the spec)."""
    from vit_serve.serve.app import create_app
    from vit_serve.serve.settings import ServeSettings

    paths = create_app(ServeSettings(model="unused.safetensors")).openapi()["paths"]
    cases = []
    for path, item in paths.items():
        for method, op in item.items():
            cases.append((method.upper(), path, "positive"))
            if op.get("parameters") or op.get("requestBody"):
                cases.append((method.upper(), path, "negative"))
    return cases


CASES = _operations()
OPERATIONS = sorted({(m, p) for m, p, _ in CASES})


# One test per operation and generation mode (schemathesis' own pytest loader, `from_fixture`, fails under pytest 9:
# it sets `request.node._nodeid`, which pytest 9 no longer has).
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_no_server_errors(api, method, path, mode):
    """Generated requests (valid per the spec, or `negative`: violating it) never get a 5xx; a 503 / 504 would be
    an overload, and none is expected either, one request at a time. A failure names the request as curl."""
    operation = api[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=EXAMPLES_V2_INFER if path.endswith("/infer") else EXAMPLES, deadline=None,
              derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def run(case):
        statuses.append(case.call_and_validate(checks=[not_a_server_error]).status_code)

    try:
        run()
    except Unsatisfiable:
        pytest.skip(f"{method} {path} has no input that could violate its spec")
    print(f"{method} {path} {mode}: {len(statuses)} requests, statuses {dict(sorted(Counter(statuses).items()))}")
    assert statuses
    if mode == "positive" and (path in ("/classify", "/explain") or path.startswith("/v2/models")):
        # the real images (and known ids and model names) reach the model with generated parameters
        assert 200 in statuses, f"no generated {method} {path} request succeeded: {Counter(statuses)}"


def test_the_schema_covers_the_image_routes(api):
    """The routes above are really exercised: the uploads are multipart (and raw image/*) in the spec."""
    for key in (("POST", "/classify"), ("POST", "/explain"), ("GET", "/explain")):
        assert key in OPERATIONS, f"{key} missing from /openapi.json"
    content = api.raw_schema["paths"]["/classify"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in content and "image/*" in content
    assert content["multipart/form-data"]["schema"]["properties"]["file"]["format"] == "binary"
