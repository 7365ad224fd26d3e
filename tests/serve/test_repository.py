"""A gateway serving a repository (`vit_serve.serve.repository`): three models, each answering as its own
single-model server; tritonclient's repository calls (index, load, unload); model control modes; a broken model
that leaves the others serving; labelled metrics; and hot reload under load."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpcore
import httpx
import numpy as np
import pytest
from gateway_helpers import LABELS, RES, live_server, metric, run, serving, settings_for

import vit_serve

JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def gap_ckpt(tmp_path_factory, randomize) -> Path:
    """A global-average-pooling ViT (no [class] token read-out) at 32x32."""
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=5, img_size=(32, 32), pool="gap",
                                             class_token=False), seed=3)
    path = tmp_path_factory.mktemp("gap") / "gap.safetensors"
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="module")
def second_ckpt(tmp_path_factory, randomize) -> Path:
    """Version 2 of the tiny model: same architecture and labels, other weights."""
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=RES), seed=2)
    model.labels = list(LABELS)
    path = tmp_path_factory.mktemp("v2") / "tiny_v2.safetensors"
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="module")
def wide_onnx(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint exported at a second resolution, 64x96."""
    import vit_export

    result = vit_export.export(tiny_ckpt, vit_export.ExportOptions(res=(64, 96), out=tmp_path_factory.mktemp("wide"),
                                                                   name="wide"))
    assert result.ok
    return result.onnx


def _copy_export(onnx: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in onnx.parent.glob(f"{onnx.stem}*"):
        shutil.copy(f, folder / f.name)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_onnx, second_ckpt, wide_onnx, gap_ckpt) -> Path:
    """vit/1 (ONNX at 32x48) and vit/2 (a checkpoint) with config.pbtxt `version_policy { all {} }`; wide.onnx
    (the same checkpoint at 64x96) and gap.safetensors as files."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    root = tmp_path_factory.mktemp("repo")
    _copy_export(tiny_onnx, root / "vit" / "1")
    (root / "vit" / "2").mkdir()
    shutil.copy(second_ckpt, root / "vit" / "2" / "model.safetensors")
    config = pb.ModelConfig(name="vit", version_policy=pb.ModelVersionPolicy(all=pb.ModelVersionPolicy.All()))
    (root / "vit" / "config.pbtxt").write_text(text_format.MessageToString(config))
    _copy_export(wide_onnx, root)
    shutil.copy(gap_ckpt, root / "gap.safetensors")
    return root


def _pixels(res: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(2, 3, *res)).astype(np.float32)


async def _answers(client: httpx.AsyncClient, name: str, version: str | None, res: tuple[int, int],
                   photo: bytes) -> tuple[np.ndarray, list]:
    """(/v2 logits of fixed pixels, /classify predictions of a photo) from one model."""
    x = _pixels(res, 0)
    path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": [{"name": "logits"}]}
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    logits = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(2, -1)
    q = f"?top_k=5&model={name}" + (f"&version={version}" if version else "")
    c = await client.post(f"/classify{q}", content=photo, headers=JPEG)
    assert c.status_code == 200, c.text
    return logits, c.json()["predictions"]


def test_each_model_answers_as_its_own_single_model_server(repo, tiny_onnx, second_ckpt, wide_onnx, gap_ckpt,
                                                            photos):
    photo = photos["coffee.jpg"]
    cases = [("vit", "1", tiny_onnx, RES), ("vit", "2", second_ckpt, RES), ("wide", None, wide_onnx, (64, 96)),
             ("gap", None, gap_ckpt, (32, 32))]

    async def scenario():
        got = {}
        async with serving(settings_for(repo)) as (client, _):
            for name, version, _, res in cases:
                got[name, version] = await _answers(client, name, version, res, photo)
            listing = (await client.get("/models")).json()
            meta = (await client.get("/v2/models/vit")).json()
            newest = (await client.post("/classify", params={"model": "vit"}, content=photo, headers=JPEG)).json()
            several = await client.post("/classify", content=photo, headers=JPEG)
        want = {}
        for name, version, path, res in cases:
            async with serving(settings_for(path, model_name=name)) as (client, _):
                want[name, version] = await _answers(client, name, None, res, photo)
        return got, want, listing, meta, newest, several

    got, want, listing, meta, newest, several = run(scenario())
    for key in want:
        np.testing.assert_allclose(got[key][0], want[key][0], atol=1e-5, err_msg=str(key))
        assert [p["index"] for p in got[key][1]] == [p["index"] for p in want[key][1]], key
        np.testing.assert_allclose([p["score"] for p in got[key][1]], [p["score"] for p in want[key][1]],
                                   atol=1e-6, err_msg=str(key))
    assert not np.allclose(got["vit", "1"][0], got["vit", "2"][0])  # the versions are told apart
    by_name = {m["name"]: m for m in listing["models"]}
    assert sorted(by_name) == ["gap", "vit", "wide"] and listing["default_model"] is None
    assert [(v["version"], v["state"], v["backend"]) for v in by_name["vit"]["versions"]] == [
        (1, "READY", "onnxruntime"), (2, "READY", "torch")]
    assert by_name["wide"]["versions"][0]["resolution"] == [64, 96]
    assert all(v["memory_bytes"] is not None for m in listing["models"] for v in m["versions"])
    assert meta["versions"] == ["2", "1"]
    assert newest["version"] == "2"  # no version named: the newest in service
    assert several.status_code == 400 and "?model=" in several.json()["detail"]


def test_default_model_unknown_names_and_versions(repo, photos):
    async def scenario():
        async with serving(settings_for(repo, default_model="wide")) as (client, _):
            return [await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG),
                    await client.post("/classify?model=nope", content=photos["coffee.jpg"], headers=JPEG),
                    await client.post("/classify?model=vit&version=7", content=photos["coffee.jpg"],
                                      headers=JPEG),
                    await client.get("/v2/models/nope"), await client.get("/v2/models/vit/versions/x"),
                    await client.get("/readyz")]

    default, unknown, version, v2_unknown, v2_version, ready = run(scenario())
    assert default.status_code == 200 and default.json()["model"] == "wide"
    assert unknown.status_code == 404 and "'gap', 'vit', 'wide'" in unknown.json()["detail"]
    assert version.status_code == 404 and "no version 7" in version.json()["detail"]
    assert v2_unknown.status_code == 404 and "error" in v2_unknown.json()
    assert v2_version.status_code == 404
    assert ready.status_code == 200 and ready.json()["model"] == "wide"


def test_default_model_must_be_in_the_repository(repo):
    from vit_serve.serve.app import create_app

    app = create_app(settings_for(repo, default_model="missing"))

    async def scenario():
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ValueError, match="--default-model 'missing' is not a model"):
        run(scenario())


def test_tritonclient_lists_loads_and_unloads(repo, photos):
    """tritonclient's own calls (the HTTP client against a real uvicorn): get_model_repository_index,
    load_model, unload_model, is_model_ready and infer, in explicit model control."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    settings = settings_for(repo, model_control="explicit", load_models=["gap"], allow_any_key_admin=True)
    with live_server(settings) as url:
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        first = client.get_model_repository_index()
        assert {row["name"]: row.get("state") for row in first} == {"gap": "READY", "vit": None, "wide": None}
        assert not client.is_model_ready("wide")
        client.load_model("wide")
        assert client.is_model_ready("wide")
        x = _pixels((64, 96), 1)
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert client.infer("wide", [inp]).as_numpy("logits").shape == (2, 10)
        client.load_model("vit")  # version_policy all: both versions
        ready = client.get_model_repository_index()
        assert sorted((r["name"], r.get("version"), r.get("state")) for r in ready) == [
            ("gap", "1", "READY"), ("vit", "1", "READY"), ("vit", "2", "READY"), ("wide", "1", "READY")]
        client.unload_model("wide")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(r.get("state") == "UNLOADING"
                                                  for r in client.get_model_repository_index()):
            time.sleep(0.05)
        index = {(r["name"], r.get("version")): (r.get("state"), r.get("reason"))
                 for r in client.get_model_repository_index()}
        assert index["wide", "1"] == ("UNAVAILABLE", "unloaded")
        assert not client.is_model_ready("wide")
        gone = httpx.post(f"{url}/classify?model=wide", content=photos["coffee.jpg"], headers=JPEG)
        assert gone.status_code == 503 and "not loaded" in gone.json()["detail"]
        with pytest.raises(InferenceServerException, match="no such model"):
            client.load_model("nope")
        only_ready = httpx.post(f"{url}/v2/repository/index", json={"ready": True}).json()
        assert {r["name"] for r in only_ready} == {"gap", "vit"}


def test_load_and_unload_need_explicit_model_control(repo):
    async def scenario(**kw):
        async with serving(settings_for(repo, allow_any_key_admin=True, **kw)) as (client, _):
            return [await client.post("/v2/repository/models/gap/load"),
                    await client.post("/v2/repository/models/gap/unload"),
                    await client.post("/v2/repository/index")]

    load, unload, index = run(scenario())
    assert load.status_code == 400 and "model control is none" in load.json()["error"]
    assert unload.status_code == 400 and index.status_code == 200
    off = run(scenario(repository_api=False))
    assert [r.status_code for r in off] == [403, 403, 403]
    assert "turned off" in off[2].json()["error"]


def test_a_model_that_fails_to_load_leaves_the_others_serving(tmp_path, tiny_onnx, gap_ckpt, photos):
    import hashlib
    import json

    (tmp_path / "broken.onnx").write_bytes(b"not an onnx graph")
    # its manifest records the broken file's own sha256, so that the file passes the integrity check and
    # onnxruntime is what refuses it (a mismatch is test_graph_integrity's)
    manifest = json.loads(tiny_onnx.with_suffix(".json").read_text())
    manifest["file_sha256"] = hashlib.sha256(b"not an onnx graph").hexdigest()
    (tmp_path / "broken.json").write_text(json.dumps(manifest))
    shutil.copy(gap_ckpt, tmp_path / "gap.safetensors")

    async def scenario():
        async with serving(settings_for(tmp_path, default_model="gap")) as (client, _):
            return (await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG),
                    await client.post("/classify?model=broken", content=photos["coffee.jpg"], headers=JPEG),
                    (await client.get("/models")).json(), await client.get("/readyz"))

    ok, broken, listing, ready = run(scenario())
    assert ok.status_code == 200
    assert broken.status_code == 503 and "cannot load" in broken.json()["detail"]
    row = next(m for m in listing["models"] if m["name"] == "broken")["versions"][0]
    assert row["state"] == "UNAVAILABLE" and "onnxruntime cannot load broken.onnx" in row["reason"]
    assert ready.status_code == 200


def test_metrics_are_labelled_by_model_and_version(repo, photos):
    async def scenario():
        async with serving(settings_for(repo)) as (client, _):
            for q in ("model=gap", "model=gap", "model=vit&version=1"):
                assert (await client.post(f"/classify?{q}", content=photos["coffee.jpg"],
                                          headers=JPEG)).status_code == 200
            return (await client.get("/metrics")).text

    text = run(scenario())
    assert metric(text, "vit_serve_batch_size_sum", task="classify", model="gap", version="1") == 2
    assert metric(text, "vit_serve_batch_size_sum", task="classify", model="vit", version="1") == 1
    assert metric(text, "vit_serve_batch_size_sum", task="classify", model="vit", version="2") == 0
    assert metric(text, "vit_serve_ready", model="wide", version="1") == 1
    assert metric(text, "vit_serve_model_memory_bytes", model="gap", version="1") > 0


class _Connection(httpcore.AsyncNetworkStream):
    """One client TCP connection (httpcore's own stream underneath) that keeps its history, so that a transport
    error names the connection it came on: its local port, when it opened, the requests it carried, and how long
    before the error it last sent and received bytes (a connection idle for the server's keep-alive, 5 s, is one
    the server may close as the next request arrives)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, t0: float) -> None:
        self.stream, self.t0 = stream, t0
        self.port = stream.get_extra_info("client_addr")[1]
        self.opened, self.requests = time.monotonic(), 0
        self.last_read: float | None = None
        self.last_write: float | None = None

    def describe(self, op: str) -> str:
        now = time.monotonic()
        ago = {k: "never" if t is None else f"{now - t:.3f} s before" for k, t in (("read", self.last_read),
                                                                                   ("write", self.last_write))}
        return (f"{op} failed on the connection from local port {self.port}, opened {self.opened - self.t0:.2f} s "
                f"in, request {self.requests} on it; bytes last received {ago['read']}, last sent {ago['write']}")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            data = await self.stream.read(max_bytes, timeout)
        except Exception as e:
            e.add_note(self.describe("read"))
            raise
        self.last_read = time.monotonic()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self.last_write is None or (self.last_read is not None and self.last_read > self.last_write):
            self.requests += 1  # the first bytes after an answer: a new request
        try:
            await self.stream.write(buffer, timeout)
        except Exception as e:
            e.add_note(self.describe("write"))
            raise
        self.last_write = time.monotonic()

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class _Connections(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, handing out `_Connection`s."""

    def __init__(self, t0: float) -> None:
        self.inner, self.t0 = httpcore.AnyIOBackend(), t0

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _Connection(await self.inner.connect_tcp(host, port, timeout, local_address, socket_options), self.t0)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def test_hot_reload_under_load(tmp_path, tiny_ckpt, second_ckpt, photos):
    """50 concurrent clients for 20 s with --model-control poll: version 2 dropped in (switched to within the
    poll interval plus its warm-up), a corrupt version 3 dropped in (refused with its reason, version 2 keeps
    serving), then versions 3 and 1 removed. No request fails and the answers never switch back. The clients share
    one httpcore pool (httpx's) whose connections record their history: a transport error is logged with the
    connection it came on."""
    model = tmp_path / "vit"
    (model / "1").mkdir(parents=True)
    shutil.copy(tiny_ckpt, model / "1" / "w.safetensors")
    poll_s, clients, duration = 0.5, 50, 20.0
    settings = settings_for(tmp_path, model_control="poll", repository_poll_s=poll_s, default_model="vit",
                            max_queue=1024)
    photo = photos["chelsea.jpg"]

    def drop(version: int, source: Path | None) -> float:
        """Write the version into a hidden folder, then rename it into place (what a deploy script does)."""
        staging = tmp_path / f".staging{version}"
        staging.mkdir()
        if source is None:
            (staging / "w.safetensors").write_bytes(b"corrupt")
        else:
            shutil.copy(source, staging / "w.safetensors")
        staging.rename(model / str(version))
        return time.monotonic()

    with live_server(settings) as url:
        async def load() -> tuple[list[tuple[float, float, int, str]], dict]:
            log: list[tuple[float, float, int, str]] = []  # (sent, answered, status, version)
            events: dict[str, float] = {}
            stop = time.monotonic() + duration
            timeouts = {"timeout": {"connect": 60, "read": 60, "write": 60, "pool": 60}}
            async with httpcore.AsyncConnectionPool(max_connections=clients,
                                                    network_backend=_Connections(stop - duration)) as pool:
                async def post(path: str, content: bytes = b"", headers: dict | None = None) -> httpcore.Response:
                    return await pool.request("POST", f"{url}{path}", content=content, headers=headers,
                                              extensions=timeouts)

                async def worker() -> None:
                    while (sent := time.monotonic()) < stop:
                        try:
                            r = await post("/classify?top_k=1", photo, JPEG)
                        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException) as e:
                            # logged (status 0) with when it happened and on which connection, and failed
                            where = "; ".join(getattr(e, "__notes__", []))
                            log.append((sent, time.monotonic(), 0, f"{type(e).__name__}: {e} "
                                        f"({sent - (stop - duration):.2f} s in; {where}; events {events})"))
                            continue
                        body = r.content.decode()
                        log.append((sent, time.monotonic(), r.status, json.loads(body).get("version", body)))

                async def operator() -> None:
                    loop = asyncio.get_running_loop()
                    await asyncio.sleep(4)
                    events["v2"] = await loop.run_in_executor(None, drop, 2, second_ckpt)
                    await asyncio.sleep(6)
                    events["v3"] = await loop.run_in_executor(None, drop, 3, None)
                    await asyncio.sleep(4)
                    events["index"] = json.loads((await post("/v2/repository/index")).content)
                    shutil.rmtree(model / "3")
                    shutil.rmtree(model / "1")
                    await asyncio.sleep(3)
                    events["end"] = json.loads((await post("/v2/repository/index")).content)

                await asyncio.gather(operator(), *(worker() for _ in range(clients)))
            return log, events

        log, events = asyncio.run(load())
    assert log and all(status == 200 for *_, status, _ in log), [e for e in log if e[2] != 200][:3]
    switched_at = min(done for _, done, _, v in log if v == "2")  # the first answer of version 2
    assert events["v2"] < switched_at and {v for _, done, _, v in log if done < events["v2"]} == {"1"}
    # sent after the switch: version 2 only, never back (answers of version 1 after it were sent before it)
    assert {v for sent, _, _, v in log if sent > switched_at} == {"2"}
    assert switched_at - events["v2"] <= poll_s + 10.0  # the poll interval plus loading and warming up
    index = {(r["name"], r.get("version")): (r.get("state"), r.get("reason")) for r in events["index"]}
    assert index["vit", "2"] == ("READY", "")
    assert index["vit", "3"][0] == "UNAVAILABLE" and "cannot load" in index["vit", "3"][1]
    assert {r.get("version") for r in events["end"]} == {"2"}
    assert len(log) >= clients  # every client got answers


def test_poll_reloads_a_version_rewritten_in_place(tmp_path, tiny_ckpt, second_ckpt, photos):
    """--model-control poll: the files of version 1 replaced in place (new weights, same version number) are
    loaded again and switched in; the answers change to the new weights'."""
    (tmp_path / "vit" / "1").mkdir(parents=True)
    target = tmp_path / "vit" / "1" / "w.safetensors"
    shutil.copy(tiny_ckpt, target)

    async def scenario():
        settings = settings_for(tmp_path, model_control="poll", repository_poll_s=0.2)
        async with serving(settings) as (client, _):
            before = (await client.post("/classify?top_k=10", content=photos["coffee.jpg"], headers=JPEG)).json()
            staged = tmp_path / ".w.tmp"
            shutil.copy(second_ckpt, staged)
            staged.replace(target)  # atomic: a poll sees the old file or the new one
            for _ in range(200):
                await asyncio.sleep(0.1)
                after = (await client.post("/classify?top_k=10", content=photos["chelsea.jpg"],
                                           headers=JPEG)).json()
                again = (await client.post("/classify?top_k=10", content=photos["coffee.jpg"],
                                           headers=JPEG)).json()
                if again["predictions"] != before["predictions"]:
                    return before, again, after
            return before, None, None

    before, again, _ = run(scenario())
    assert again is not None, "the rewritten version was never switched in"
    assert again["version"] == before["version"] == "1"


def test_each_model_batches_by_its_own_config_toml(tmp_path, tiny_ckpt, photos):
    """Two models of one repository, each with a config.toml: "a" batches up to 4 with a long window on two
    instances, "b" runs one image at a time as a TorchScript trace; the server's flags (max_batch 16, 5 ms) are
    only the defaults."""
    for name, toml in (("a", "max_batch = 4\nmax_delay_ms = 1000\ninstances = 2\n"),
                       ("b", "max_batch = 1\ntorchscript = true\n")):
        (tmp_path / name / "1").mkdir(parents=True)
        shutil.copy(tiny_ckpt, tmp_path / name / "1" / "w.safetensors")
        (tmp_path / name / "config.toml").write_text(toml)

    async def scenario():
        async with serving(settings_for(tmp_path, max_batch=16, max_delay_ms=5)) as (client, _):
            answers = {name: await asyncio.gather(*(client.post(f"/classify?model={name}", content=photo,
                                                                headers=JPEG)
                                                    for photo in [photos["coffee.jpg"]] * 8))
                       for name in ("a", "b")}
            return answers, (await client.get("/models")).json(), (await client.get("/metrics")).text

    answers, listing, text = run(scenario())
    assert all(r.status_code == 200 for rs in answers.values() for r in rs)
    sizes = {name: [r.json()["timing_ms"]["batch_size"] for r in rs] for name, rs in answers.items()}
    assert max(sizes["a"]) > 1 and max(sizes["a"]) <= 4  # batched, never beyond its own max_batch
    assert sizes["b"] == [1] * 8
    assert metric(text, "vit_serve_batch_size_count", task="classify", model="b") == 8
    rows = {m["name"]: m["versions"][0] for m in listing["models"]}
    assert rows["a"]["batching"]["max_batch"] == 4 and rows["a"]["batching"]["instances"] == 2
    assert rows["a"]["batching"]["max_delay_ms"] == 1000
    assert (rows["b"]["batching"]["max_batch"], rows["b"]["batching"]["max_delay_ms"]) == (1, 5)  # server's delay
    assert (rows["a"]["torchscript"], rows["b"]["torchscript"]) == (False, True)
