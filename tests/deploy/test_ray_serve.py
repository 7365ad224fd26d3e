"""vit_serve.deploy.ray on a real local Ray cluster (`ray.init(num_cpus=2)`, Ray Serve's own HTTP proxy on a free
port): two gateway ingress replicas in front of two replicas of one model deployment, the explain store in a real
Redis (Debian's `redis-server`).

Checked against things this project did not write: Ray's own list of replica actors (every answer's replica is
one of them, and both answer), the gateway of `create_app` in this process (the same answers: logits, rollout
maps, top-k, within 1e-6), Redis holding the crop that the other ingress replica explains, and Prometheus's text
parser reading the batch sizes (concurrent requests ran in batches of more than one image in the replicas).
Without Ray installed, `import vit_serve.deploy.ray` is one ImportError naming the extra, and vit_serve.serve
never imports Ray.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import vit_serve
from vit_serve.preprocess import preprocess
from vit_serve.tune.server_process import free_port

RES = (32, 48)
LABELS = [f"label_{i}" for i in range(10)]
REPLICA = "x-ray-replica"


def _settings(model: Path, **kw: Any):
    from vit_serve.serve.settings import ServeSettings

    base = {"model": str(model), "device": "cpu", "threads": 1, "decode_workers": 1, "decode": "contract"}
    return ServeSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny) -> Path:
    """A 2-block Ti/16 at 32x48 with random non-trivial weights and an ImageNet-style contract."""
    return save_tiny(tmp_path_factory.mktemp("ray_model") / "tiny.safetensors", RES, 3, LABELS)


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """scikit-image's sample photos as JPEG."""
    data = pytest.importorskip("skimage.data")
    out = {}
    for name in ("astronaut", "coffee", "chelsea"):
        buf = io.BytesIO()
        Image.fromarray(getattr(data, name)()).save(buf, format="JPEG", quality=92)
        out[name] = buf.getvalue()
    return out


@pytest.fixture(scope="module")
def repo(ckpt, tmp_path_factory) -> Path:
    """A repository of two models: tiny, and broken (a checkpoint file that is not one)."""
    folder = tmp_path_factory.mktemp("ray_repo")
    (folder / "tiny.safetensors").write_bytes(ckpt.read_bytes())
    (folder / "broken.safetensors").write_bytes(b"not a checkpoint")
    return folder


@pytest.fixture(scope="module")
def cluster(repo, redis_url) -> Iterator[dict[str, Any]]:
    """The application on a local 2-CPU Ray cluster: 2 ingress replicas (half a CPU each), 2 replicas of each
    model deployment (a quarter each), Redis as the store; yields its URL, settings and tiny's deployment."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from vit_serve.deploy.ray import run, start_ray
    from vit_serve.runtime.backends.ray import deployment_name

    port = free_port()
    settings = _settings(repo, default_model="tiny", store=redis_url, max_batch=16, max_delay_ms=50, port=port)
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        run(settings, blocking=False, num_replicas=2, ray_actor_options={"num_cpus": 0.25}, ingress_replicas=2,
            ingress_actor_options={"num_cpus": 0.5})
        url = f"http://127.0.0.1:{port}"
        ready: set[str] = set()  # both ingress replicas warmed up (each warm-up is one model run)
        # Ray and Serve alone took 71 s to start on a CI machine whose other test worker was busy: room for both
        # ingress replicas to load and warm up after that
        deadline = time.monotonic() + 240
        while len(ready) < 2:
            r = httpx.get(f"{url}/readyz", timeout=30)
            if r.status_code == 200:
                ready.add(r.headers[REPLICA])
            if time.monotonic() >= deadline:
                models = httpx.get(f"{url}/models", timeout=30).text
                pytest.fail(f"the application did not become ready: {r.text}; GET /models: {models}")
            time.sleep(0.1)
        yield {"url": url, "settings": settings,
               "deployment": deployment_name("tiny", (repo / "tiny.safetensors").resolve())}
    finally:
        serve.shutdown()
        ray.shutdown()


def _ray_replicas(deployment: str) -> set[str]:
    """The replica ids of a deployment, from Ray's list of named actors (`SERVE_REPLICA::app#deployment#id`)."""
    import ray

    from vit_serve.deploy.ray import APP_NAME

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def _per_ingress(url: str, path: str, want: int = 2, tries: int = 60) -> dict[str, httpx.Response]:
    """GET `path` until `want` ingress replicas have answered: {replica id: its last answer}."""
    seen: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(tries):
            r = client.get(path)
            seen[r.headers[REPLICA]] = r
            if len(seen) >= want:
                break
    return seen


def _v2_body(x: np.ndarray, outputs: list[str]) -> dict[str, Any]:
    return {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": [{"name": n} for n in outputs]}


def _v2_outputs(r: httpx.Response) -> dict[str, np.ndarray]:
    assert r.status_code == 200, r.text
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}


def test_concurrent_requests_reach_both_model_replicas_and_run_there_in_batches(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, 3, *RES)).astype(np.float32) for _ in range(32)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=120) as client:
            return await asyncio.gather(*(client.post("/v2/models/tiny/infer", json=_v2_body(x, ["logits"]))
                                          for x in xs))

    answers = asyncio.run(burst())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:1]

    requests: dict[str, float] = {}
    batches: list[tuple[float, float]] = []  # (le, cumulative count) of every ingress replica's histogram
    pages = _per_ingress(cluster["url"], "/metrics")
    assert len(pages) == 2, f"one ingress replica answered /metrics: {list(pages)}"
    for page in pages.values():
        for family in text_string_to_metric_families(page.text):
            for sample in family.samples:
                if sample.name == "vit_serve_ray_requests_total":
                    requests[sample.labels["replica"]] = requests.get(sample.labels["replica"], 0) + sample.value
                elif sample.name == "vit_serve_ray_batch_size_bucket":
                    batches.append((float(sample.labels["le"]), sample.value))
    replicas = _ray_replicas(cluster["deployment"])
    print(f"requests per model replica: {requests}; Ray's replicas: {sorted(replicas)}")
    assert len(replicas) == 2
    assert set(requests) == replicas and all(n > 0 for n in requests.values())
    # 32 requests + each ingress replica's warm-up (+ readiness probes, which are no model runs)
    assert sum(requests.values()) == 32 + 2
    total = sum(n for le, n in batches if le == float("inf"))
    alone = sum(n for le, n in batches if le == 1.0)
    print(f"requests that ran in a batch of more than one image: {total - alone:g} of {total:g}")
    assert total - alone > 0


def test_answers_equal_the_single_gateway(cluster, ckpt, photos, ready_client):
    local_settings = _settings(ckpt)
    cfg = vit_serve.load(ckpt).preprocess_cfg
    x = torch.stack([preprocess(data, cfg) for data in photos.values()]).numpy()
    body = _v2_body(x, ["logits", "rollout"])
    with httpx.Client(base_url=cluster["url"], timeout=120) as ray_client, ready_client(local_settings) as local_client:
        on_ray = _v2_outputs(ray_client.post("/v2/models/tiny/infer", json=body))
        local = _v2_outputs(local_client.post("/v2/models/tiny/infer", json=body))
        for name in ("logits", "rollout"):
            diff = float(np.abs(on_ray[name] - local[name]).max())
            print(f"{name}: max |Ray - single gateway| = {diff:.2e}")
            assert on_ray[name].shape == local[name].shape and diff <= 1e-6
        for data in photos.values():
            a = ray_client.post("/classify?top_k=5", content=data, headers={"Content-Type": "image/jpeg"}).json()
            b = local_client.post("/classify?top_k=5", content=data, headers={"Content-Type": "image/jpeg"}).json()
            assert a["id"] == b["id"]
            assert [p["index"] for p in a["predictions"]] == [p["index"] for p in b["predictions"]]
            assert [p["label"] for p in a["predictions"]] == [p["label"] for p in b["predictions"]]
            np.testing.assert_allclose([p["score"] for p in a["predictions"]],
                                       [p["score"] for p in b["predictions"]], rtol=0, atol=1e-6)


def test_explain_by_id_works_across_ingress_replicas_through_redis(cluster, ckpt, photos, redis_url,
                                                                  ready_client):
    import redis

    from vit_serve.serve.stores.redis import PREFIX
    from vit_serve.serve.stores.secret import StoreSecret

    classified: dict[str, str] = {}  # image id -> the ingress replica that classified it
    uploads: dict[str, bytes] = {}
    with httpx.Client(base_url=cluster["url"], timeout=120) as client:
        for data in list(photos.values()) * 4:
            r = client.post("/classify", content=data, headers={"Content-Type": "image/jpeg"})
            assert r.status_code == 200, r.text
            classified.setdefault(r.json()["id"], r.headers[REPLICA])
            uploads[r.json()["id"]] = data
        stored = [k.decode() for k in redis.Redis.from_url(redis_url).keys(f"{PREFIX}*")]
        # the ingress replicas get these settings' secret
        secret = StoreSecret.from_settings(cluster["settings"].explain_store)
        slots = {image: secret.slot("", image) for image in classified}  # no API keys: the shared scope
        assert all(any(key.startswith(f"{PREFIX}{slots[image]}:") for key in stored) for image in classified), stored

        crossed: dict[str, dict[str, Any]] = {}  # image id -> the answer of the replica that never saw it
        for _ in range(40):
            for image, first in classified.items():
                if image not in crossed:
                    r = client.get(f"/explain?id={image}&format=json")
                    assert r.status_code == 200, r.text
                    if r.headers[REPLICA] != first:
                        crossed[image] = r.json()
            if len(crossed) == len(classified):
                break
        print(f"{len(crossed)} of {len(classified)} images explained by the other ingress replica")
        assert crossed, "every GET /explain went to the ingress replica that classified the image"
        assert client.get(f"/explain?id={'0' * 64}").status_code == 404  # an id nobody classified

    with ready_client(_settings(ckpt)) as local:  # the single gateway, the same uploads
        for image, answer in crossed.items():
            assert local.post("/classify", content=uploads[image], headers={"Content-Type": "image/jpeg"}
                              ).json()["id"] == image
            reference = local.get(f"/explain?id={image}&format=json").json()
            assert answer["grid"] == reference["grid"]
            diff = float(np.abs(np.array(answer["map"], float) - np.array(reference["map"], float)).max())
            assert diff <= 1e-6, diff


def test_a_model_that_cannot_load_is_shown_with_the_single_gateways_reason_and_the_other_serves(cluster, repo,
                                                                                               ready_client):
    def states(models: dict[str, Any]) -> dict[str, tuple[str, str]]:
        return {m["name"]: (m["versions"][0]["state"], m["versions"][0]["reason"]) for m in models["models"]}

    on_ray = states(httpx.get(f"{cluster['url']}/models", timeout=60).json())
    with ready_client(_settings(repo, default_model="tiny")) as local:
        reference = states(local.get("/models").json())
    print(f"broken on Ray: {on_ray['broken']}")
    assert on_ray == reference
    assert on_ray["tiny"] == ("READY", "") and on_ray["broken"][0] == "UNAVAILABLE"
    assert on_ray["broken"][1].startswith("cannot load: ") and "\n" not in on_ray["broken"][1]


def test_one_model_that_cannot_load_fails_the_start_with_its_reason_in_one_line(cluster, tmp_path):
    from vit_serve.deploy.ray import run

    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError) as e:  # a second application on the running cluster, no CPU reserved
        run(_settings(broken), blocking=False, name="broken", route_prefix="/broken",
            ray_actor_options={"num_cpus": 0}, ingress_actor_options={"num_cpus": 0})
    print(e.value)
    assert str(e.value).startswith(f"the Ray Serve application did not start: cannot serve {broken}: cannot read ")
    assert "\n" not in str(e.value) and "corrupt safetensors" in str(e.value)


def test_the_local_cluster_gives_the_proxy_time_to_start(cluster):
    """Ray Serve kills an HTTP proxy not ready in 5 s, which failed serve.start on a loaded 2-core machine: the
    cluster `start_ray` starts hands its processes a longer limit (read by the Serve controller)."""
    import ray

    from vit_serve.deploy.ray import SERVE_ENV_DEFAULTS

    @ray.remote(num_cpus=0)
    def environment(names: list[str]) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    seen = ray.get(environment.remote(list(SERVE_ENV_DEFAULTS)), timeout=120)
    print(f"the cluster's workers see {seen}")
    assert seen == {name: os.environ[name] for name in SERVE_ENV_DEFAULTS}  # start_ray set what was unset
    assert float(seen["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 30


def test_a_replica_without_a_gpu_sees_none(cluster):
    """Ray >= 2.48 leaves CUDA_VISIBLE_DEVICES alone for actors that reserve no GPU, so a CPU replica on a GPU node
    would use a GPU no one reserved: the replicas' options hide them (a task with those options, on the cluster)."""
    import ray

    from vit_serve.deploy.ray import actor_options

    options = actor_options({"num_cpus": 0})

    @ray.remote
    def visible() -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    assert ray.get(visible.options(num_cpus=0, runtime_env=options["runtime_env"]).remote(), timeout=120) == ""
    assert "runtime_env" not in actor_options({"num_gpus": 1})  # Ray sets the reserved GPU's id itself
    assert actor_options(None) == {"num_cpus": 1, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    own = actor_options({"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": "1", "A": "b"}, "pip": ["x"]}})
    assert own["runtime_env"] == {"env_vars": {"CUDA_VISIBLE_DEVICES": "1", "A": "b"}, "pip": ["x"]}


def test_resource_shortfall_names_the_numbers():
    pytest.importorskip("ray.serve")
    from vit_serve.deploy.ray import ResourceRequest, resource_shortfall

    two = {"CPU": 2.0}
    assert resource_shortfall(ResourceRequest(1, 2, 1, 0, 1, 1), two) == (
        "2 model replicas x 1 CPU + 1 ingress x 1 CPU = 3 CPUs, the cluster has 2: lower --replicas or "
        "--replica-cpus")
    assert resource_shortfall(ResourceRequest(1, 1, 1, 0, 1, 1), two) is None  # the quickstart's --replicas 1
    assert resource_shortfall(ResourceRequest(2, 2, 0.25, 0, 2, 0.5), two) is None  # exactly full
    assert resource_shortfall(ResourceRequest(1, 4, 0.5, 0, 1, 1, autoscaling=True), two) == (
        "up to 4 model replicas (--max-replicas) x 0.5 CPU + 1 ingress x 1 CPU = 3 CPUs, the cluster has 2: "
        "lower --max-replicas or --replica-cpus")
    assert resource_shortfall(ResourceRequest(3, 1, 0.5, 0, 1, 1), two, {"CPU": 2.0}) == (
        "3 model deployments x 1 replica x 0.5 CPU + 1 ingress x 1 CPU = 2.5 CPUs, the cluster has 2: lower "
        "--replicas or --replica-cpus")
    assert resource_shortfall(ResourceRequest(1, 1, 1, 0, 1, 1), {"CPU": 4.0}, {"CPU": 1.5}) == (
        "1 model replica x 1 CPU + 1 ingress x 1 CPU = 2 CPUs, the cluster has 4 (1.5 free): lower --replicas or "
        "--replica-cpus")
    assert resource_shortfall(ResourceRequest(1, 2, 1, 1, 1, 1), {"CPU": 8.0, "GPU": 1.0}) == (
        "2 model replicas x 1 GPU = 2 GPUs, the cluster has 1: lower --replicas or --replica-gpus")
    assert resource_shortfall(ResourceRequest(1, 2, 1, 0.5, 1, 1), {"CPU": 8.0, "GPU": 1.0}) is None


def test_serve_refuses_what_the_cluster_cannot_place_in_one_line(cluster, ckpt, capsys):
    """`vit-serve serve MODEL --engine ray --replicas 2` on a 2-CPU cluster: two model replicas of one CPU and the
    ingress's CPU are 3. Ray would wait for ever for the ingress ("taken more than 30s to be scheduled"); the CLI
    refuses before deploying, in one line with the numbers, and exits non-zero."""
    from vit_serve.cli import main

    code = main(["serve", str(ckpt), "--engine", "ray", "--replicas", "2", "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    print(err)
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "2 model replicas x 1 CPU + 1 ingress x 1 CPU = 3 CPUs, the cluster has 2" in err
    assert "--replicas" in err and "Traceback" not in err
    code = main(["serve", str(ckpt), "--engine", "ray", "--replicas", "1", "--max-replicas", "3", "--port",
                 str(free_port())])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "up to 3 model replicas (--max-replicas) x 1 CPU" in err, err
    assert httpx.get(f"{cluster['url']}/readyz", timeout=30).status_code == 200  # the running application is intact


def test_a_models_own_config_toml_sizes_its_deployment_from_the_command_line(cluster, ckpt, tmp_path, capsys):
    """`vit-serve serve REPO --engine ray`, REPO/big/config.toml asking 4 replicas of one CPU: the launch counts
    them (and the other model's one replica of --replica-cpus) and refuses in one line naming the model."""
    from vit_serve.cli import main

    for name in ("small", "big"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.safetensors").write_bytes(ckpt.read_bytes())
    (tmp_path / "big" / "config.toml").write_text("replicas = 4\nreplica_cpus = 1\n")
    code = main(["serve", str(tmp_path), "--engine", "ray", "--replica-cpus", "0.25", "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "1 model replica x 0.25 CPU + big: 4 x 1 CPU + 1 ingress x 1 CPU = 5.25 CPUs" in err, err


def test_a_tensorrt_engine_on_ray_needs_no_tensorrt_where_it_is_launched(cluster, tmp_path, capsys):
    """The replicas load the engine (on a GPU node with TensorRT); the launching machine only checks the file. The
    launch gets as far as the cluster check (here refused: too many replicas), not a missing TensorRT."""
    from vit_serve.cli import main
    from vit_serve.deploy.ray import check_launch

    plan = tmp_path / "model_sm90.plan"
    plan.write_bytes(b"stand-in engine")
    check_launch(_settings(plan))  # no TensorRT here, and no error
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_launch(_settings(tmp_path / "missing.plan"))
    code = main(["serve", str(plan), "--engine", "ray", "--replicas", "2", "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "= 3 CPUs, the cluster has 2" in err and "TensorRT" not in err, err


def test_the_ray_engine_outside_ray_serve_is_one_clear_error(ckpt):
    pytest.importorskip("ray.serve")
    from vit_serve.runtime import LoadSpec, load

    with pytest.raises(RuntimeError, match=r"inside Ray Serve.*vit-serve serve --engine ray"):
        load(LoadSpec.of(_settings(ckpt, engine="ray")))


def test_what_ray_serve_cannot_serve_is_refused_before_any_work(ckpt, tmp_path):
    pytest.importorskip("ray.serve")
    from vit_serve.deploy.ray import build_app

    with pytest.raises(ValueError, match="--model-control poll is not available on Ray Serve"):
        build_app(_settings(ckpt, model_control="poll"))
    with pytest.raises(ValueError, match="--grpc-port"):
        build_app(_settings(ckpt, grpc_port=0))
    with pytest.raises(ValueError, match="--backend triton"):
        build_app(_settings("vit", backend="triton"))
    with pytest.raises(FileNotFoundError):
        build_app(_settings(tmp_path / "missing.safetensors"))


def test_each_version_of_a_repository_is_its_own_deployment(ckpt, tmp_path):
    pytest.importorskip("ray.serve")
    from vit_serve.deploy.ray import served_versions
    from vit_serve.runtime.backends.ray import deployment_name

    for v in (1, 2):
        (tmp_path / "tiny" / str(v)).mkdir(parents=True)
        (tmp_path / "tiny" / str(v) / "model.safetensors").write_bytes(ckpt.read_bytes())
    chosen = served_versions(_settings(tmp_path, version_policy="all"))
    assert [(e.name, s.version) for e, s in chosen] == [("tiny", 1), ("tiny", 2)]
    names = {deployment_name(e.name, s.path) for e, s in chosen}
    assert len(names) == 2 and all(n.startswith("tiny-") for n in names)
    assert [s.version for _, s in served_versions(_settings(tmp_path))] == [2]  # the default policy, latest:1


BLOCK_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoRay())
import vit_serve.serve, vit_serve.serve.app, vit_serve.runtime.backends, vit_serve.deploy
assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules), "vit_serve.serve imported ray"
try:
    import vit_serve.deploy.ray
except ImportError as e:
    print(e)
"""


def test_without_ray_the_import_is_one_line_naming_the_extra():
    proc = subprocess.run([sys.executable, "-c", BLOCK_RAY], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "vit_serve.deploy.ray needs Ray Serve: pip install 'vit-serve[ray]' (ray[serve])"
