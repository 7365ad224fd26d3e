"""POST /v1/embeddings and GET /v1/models on the real gateway (uvicorn in a thread), called by clients nobody here
wrote: the official `openai` SDK (`client.embeddings.create`, its default base64 and encoding_format="float") and
`langchain_openai.OpenAIEmbeddings`. The model is a tiny open_clip CLIP (random weights, `open_clip.create_model(
pretrained=None)`, tests/export/test_text_tower.py's) converted by `vit-serve convert`, served twice: its checkpoint
on the torch backend (the text tower the checkpoint stores) and its export with `vit-export --text-tower`
(NAME_text.onnx on onnxruntime). References: open_clip's `encode_image` on the pixels `vit_serve.preprocess` makes
of each photo (the gateway decodes by the model's contract) and `encode_text` of open_clip's tokenizer, both
L2-normalised. Also: a mixed request's vectors equal each item's alone, OpenAI's error classes and shape for bad
input, a model without a text tower, `dimensions` on a model that declares Matryoshka training and one that does
not, the embedding-space fingerprint (/embed?normalize=true's; another for a truncation), keys (401), a key's rate
charged per item (429), a deadline (504), and the body limit before routing (413); and the text embeddings of /v2
and gRPC (a `text` BYTES input, through tritonclient)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gateway_helpers import live_app, metric, settings_for

import vit_serve
from vit_serve.preprocess import preprocess

open_clip = pytest.importorskip("open_clip")
openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "export"))
from test_text_tower import ARCH, tiny_clip  # noqa: E402

TEXTS = ["a photo of a cat", "an origami crane on a desk", "", "lighthouse at dusk"]
KEY, LIMITED = "openai-key-5d1e", "openai-limited-93ab"
TOL = 1e-4


@pytest.fixture(scope="module")
def repo(tmp_path_factory, randomize):
    """(REPO, the open_clip model): clip.safetensors (converted, with its text tower), clipx (its export with
    --text-tower: clipx.onnx, clipx_text.onnx) and mat.safetensors (an image-only ViT declaring Matryoshka
    training at 48 and 96 of its 192 dimensions)."""
    import vit_export

    from vit_serve.cli import main as serve_main

    folder = tmp_path_factory.mktemp("openai")
    model = tiny_clip(randomize, seed=7)
    torch.save(model.state_dict(), folder / "oc.pt")
    repo = folder / "repo"
    repo.mkdir()
    assert serve_main(["convert", str(folder / "oc.pt"), str(repo / "clip.safetensors"), "--arch", ARCH]) == 0
    result = vit_export.export(repo / "clip.safetensors", vit_export.ExportOptions(
        out=repo, name="clipx", text_tower=True, formats=("onnx",)))
    assert result.ok and result.text is not None
    mat = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=32))
    mat.cfg.extra["matryoshka_dims"] = [48, 96]
    vit_serve.save(mat, repo / "mat.safetensors")
    return repo, model


@pytest.fixture(scope="module")
def served(repo):
    """(base URL, the app) of a gateway over REPO without keys, with gRPC."""
    with live_app(settings_for(repo[0], default_model="clip", grpc_port=0)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _uri(data: bytes) -> str:
    kind = "png" if data.startswith(b"\x89PNG") else "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def _unit(x: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(x.double(), dim=-1).numpy()


@pytest.fixture(scope="module")
def reference(repo, photos):
    """open_clip's normalised encode_image of each photo and encode_text of TEXTS."""
    folder, model = repo
    cfg = vit_serve.load(folder / "clip.safetensors").preprocess_cfg
    x = torch.stack([preprocess(data, cfg) for data in photos.values()])
    with torch.no_grad():
        return _unit(model.encode_image(x)), _unit(model.encode_text(open_clip.tokenize(TEXTS)))


@pytest.mark.parametrize("model", ["clip", "clipx"])
def test_the_sdk_gets_open_clip_image_and_text_embeddings(client, reference, photos, model):
    images, texts = reference
    uris = [_uri(d) for d in photos.values()]
    mixed = [uris[0], TEXTS[0], uris[1], TEXTS[1], TEXTS[2], uris[2], TEXTS[3]]
    want = np.stack([images[0], texts[0], images[1], texts[1], texts[2], images[2], texts[3]])
    for fmt in ("base64", "float"):  # base64: the SDK's default, decoded by the SDK itself
        r = client.embeddings.create(model=model, input=mixed, **({"encoding_format": fmt} if fmt == "float" else {}))
        got = np.array([d.embedding for d in r.data])
        err = float(np.abs(got - want).max())
        print(f"{model} {fmt}: max |Δ| vs open_clip (normalised) = {err:.2e}")
        assert [d.index for d in r.data] == list(range(len(mixed))) and r.model == model
        assert err <= TOL
    alone = np.array([client.embeddings.create(model=model, input=item, encoding_format="float").data[0].embedding
                      for item in mixed])
    assert float(np.abs(alone - got).max()) <= 1e-5  # one item never changes another's vector
    tokens = [len(open_clip.tokenize([t])[0].nonzero()) for t in TEXTS]  # with the start and end tokens
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(tokens) + 3 * 4  # 64 px / patch 32: 4 patches


def test_jina_items_and_the_raw_json(served, reference, photos):
    import httpx

    images, texts = reference
    raw = base64.b64encode(photos["coffee.jpg"]).decode()
    r = httpx.post(f"{served[0]}/v1/embeddings", json={
        "model": "clip", "input": [{"image": raw}, {"text": TEXTS[1]}, {"image": _uri(photos["coffee.jpg"])}],
        "encoding_format": "base64", "user": "ignored"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model_version"] == "1"
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]])
    assert float(np.abs(got - np.stack([images[1], texts[1], images[1]])).max()) <= TOL
    # the space: /embed?normalize=true's, the export's the same (same weights, contract and precision)
    unit = httpx.post(f"{served[0]}/embed", params={"model": "clip", "normalize": "true"},
                      files={"file": ("coffee.jpg", photos["coffee.jpg"])}, timeout=60).json()
    other = httpx.post(f"{served[0]}/v1/embeddings", json={"model": "clipx", "input": "a cat"}, timeout=60).json()
    assert body["embedding_fingerprint"] == unit["embedding_fingerprint"] == other["embedding_fingerprint"]
    assert body["embedding_fingerprint"].startswith("vs1-")


def test_langchain_embeds_texts(served, reference):
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(base_url=f"{served[0]}/v1", api_key="unused", model="clip",
                                            check_embedding_ctx_length=False, max_retries=0)
    docs = np.array(emb.embed_documents(TEXTS[:2] + TEXTS[3:]))
    query = np.array(emb.embed_query(TEXTS[1]))
    _, texts = reference
    assert float(np.abs(docs - texts[[0, 1, 3]]).max()) <= TOL
    assert float(np.abs(query - texts[1]).max()) <= TOL


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_v2_and_grpc_embed_texts(served, reference, transport):
    """The Open Inference Protocol's `text` BYTES input (tritonclient, binary BYTES): the `embedding` output of each
    text, the tower's own (not normalised), open_clip's encode_text once normalised."""
    lib = pytest.importorskip(f"tritonclient.{transport}")
    url, app = served
    client = lib.InferenceServerClient(url.removeprefix("http://") if transport == "http" else app.state.grpc.address)
    assert {"name": "text", "datatype": "BYTES", "shape": [-1]} in [
        {**t, "shape": [int(d) for d in t["shape"]]} for t in
        (client.get_model_metadata("clip", as_json=True) if transport == "grpc" else
         client.get_model_metadata("clip"))["inputs"]]
    inp = lib.InferInput("text", [len(TEXTS)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
    got = client.infer("clip", [inp], outputs=[lib.InferRequestedOutput("embedding")]).as_numpy("embedding")
    assert got.shape == (len(TEXTS), 32)
    assert float(np.abs(got / np.linalg.norm(got, axis=1, keepdims=True) - reference[1]).max()) <= TOL
    with pytest.raises(Exception, match="answers the embedding output alone"):
        client.infer("clip", [inp], outputs=[lib.InferRequestedOutput("logits")])


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["clip", "clipx", "mat"]


def test_bad_input_is_the_sdks_bad_request_error(client, photos):
    cases = [
        ({"model": "mat", "input": "a cat"}, "mat cannot embed text: it has no text tower"),
        ({"model": "clip", "input": ["a cat", "data:image/png;base64,@@@"]}, "input[1]: the image is not valid base64"),
        ({"model": "clip", "input": [[1, 2, 3]]}, "token ids are not accepted"),
        ({"model": "clip", "input": "a cat", "dimensions": 16}, "not trained for truncated (Matryoshka)"),
        ({"model": "clip", "input": " ".join(["word"] * 100)}, "over the text tower's context length of 77"),
        ({"model": "clip", "input": [{"image": "https://example.com/cat.jpg"}]}, "image URLs are not enabled"),
        ({"model": "clip", "input": []}, "input is empty"),
        ({"model": "clip", "input": ["a"] * 17}, "17 items in one request, over the limit of 16"),  # max_batch
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(**kwargs)
        assert message in e.value.message, (kwargs, e.value.message)
        assert e.value.type == "invalid_request_error" and message in e.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.embeddings.create(model="nope", input="a cat")
    with pytest.raises(openai.UnprocessableEntityError):  # a corrupt image is 422, as on /embed
        client.embeddings.create(model="clip", input=_uri(photos["coffee.jpg"][:300]))


def test_classify_by_labels_on_the_torch_checkpoint_is_the_same_space(client, served, photos):
    """?labels= on the converted checkpoint served with torch (its stored text tower, no NAME_text.onnx) answers,
    and its scores are the softmax of exp(logit_scale) x the cosines of /v1's image and prompt vectors."""
    import httpx

    labels = ["cat", "teapot", "lighthouse"]
    r = httpx.post(f"{served[0]}/classify", params={"model": "clip", "labels": ",".join(labels), "top_k": 3},
                   files={"file": ("chelsea.jpg", photos["chelsea.jpg"])}, timeout=60)
    assert r.status_code == 200, r.text
    vectors = [d.embedding for d in client.embeddings.create(
        model="clip", input=[_uri(photos["chelsea.jpg"]), *(f"a photo of a {c}." for c in labels)]).data]
    logits = (1 / 0.07) * np.array(vectors[1:]) @ np.array(vectors[0])  # the fixture's logit scale
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    got = {p["label"]: p["score"] for p in r.json()["predictions"]}
    assert max(abs(got[c] - want[i]) for i, c in enumerate(labels)) <= TOL


def test_dimensions_on_a_matryoshka_model(client, photos):
    uri = _uri(photos["astronaut.png"])
    full = np.array(client.embeddings.create(model="mat", input=uri, encoding_format="float").data[0].embedding)
    short = np.array(client.embeddings.create(model="mat", input=uri, encoding_format="float",
                                              dimensions=48).data[0].embedding)
    assert full.shape == (192,) and short.shape == (48,)
    spaces = [client.embeddings.create(model="mat", input=uri, **kw).embedding_fingerprint
              for kw in ({}, {"dimensions": 48}, {"dimensions": 96})]
    assert len(set(spaces)) == 3 and None not in spaces  # a truncated vector is another space
    assert float(np.abs(short - full[:48] / np.linalg.norm(full[:48])).max()) <= 1e-6
    with pytest.raises(openai.BadRequestError, match="dimensions must be from 48 to 192"):
        client.embeddings.create(model="mat", input=uri, dimensions=8)


def test_deadline_and_metrics(client, served, photos):
    import httpx

    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="clip", input=_uri(photos["coffee.jpg"]), extra_query={"timeout_ms": 1e-3})
    assert e.value.status_code == 504 and "deadline" in e.value.message
    text = httpx.get(f"{served[0]}/metrics").text
    assert metric(text, "vit_serve_requests_total", endpoint="/v1/embeddings", status="200") >= 1
    assert metric(text, "vit_serve_batch_size_count", model="clip") >= 1  # its images went through the batcher


@pytest.fixture(scope="module")
def keyed(repo, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\n{LIMITED} name=limited rate=1 burst=2\n")
    settings = settings_for(repo[0], default_model="clip", api_keys_file=str(keys), max_body_bytes=4096)
    with live_app(settings) as (url, _):
        yield url


def test_keys_rates_and_the_body_limit_answer_in_openais_shape(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0).embeddings.create(model="clip", input="x")
    assert e.value.body == {"message": "the API key is not valid", "type": "authentication_error", "param": None,
                            "code": "invalid_api_key"}
    ok = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == ["clip", "clipx", "mat"]
    with pytest.raises(openai.APIStatusError) as e:
        ok.embeddings.create(model="clip", input="x" * 5000)
    assert e.value.status_code == 413 and "VIT_SERVE_MAX_BODY_BYTES" in e.value.body["message"]
    limited = openai.OpenAI(base_url=f"{keyed}/v1", api_key=LIMITED, max_retries=0)
    assert len(limited.embeddings.create(model="clip", input=["a", "b", "c"]).data) == 3  # 1 + 2 items charged
    with pytest.raises(openai.RateLimitError) as e:  # the bucket is below zero: the next request waits
        limited.embeddings.create(model="clip", input="a")
    assert e.value.body["code"] == "rate_limit_exceeded"


def test_openvino_serves_the_clip_tower_within_its_precisions_bounds(repo, reference, photos):
    """The export's image tower on OpenVINO at its automatic precision (bf16 on a CPU with it, issue 43): its image
    vectors against open_clip's normalised encode_image on the photos, within that precision's cosine bound
    (`vit_serve.accuracy_bounds`), the accuracy gate passed at load, and its fingerprint that precision's."""
    pytest.importorskip("openvino")
    from vit_serve.accuracy_bounds import BOUNDS, cosines
    from vit_serve.runtime.backends import LoadSpec, load

    backend = load(LoadSpec(path=str(repo[0] / "clipx.onnx"), backend="openvino", threads=1, cache_dir=""))
    info = backend.info
    x = np.stack([preprocess(data, info.preprocess).numpy() for data in photos.values()])
    _, vectors = backend.embed(x)
    images, _ = reference
    cos = cosines(images, vectors.astype(np.float64))
    bound = BOUNDS[info.precision][1] if info.precision in BOUNDS else 1 - 1e-6
    print(f"OpenVINO {info.precision}: cosine to open_clip's encode_image >= {cos.min():.6f} (bound {bound})")
    assert cos.min() >= bound
    assert info.precision == "fp32" or (info.accuracy is not None and info.accuracy.check.ok)
    assert info.embedding_space.precision == info.precision
