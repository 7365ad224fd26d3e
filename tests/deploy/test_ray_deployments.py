"""Each model's Ray Serve deployment is sized by its own REPO/NAME/config.toml (replicas, max_replicas,
replica_cpus, replica_gpus), as Ray Serve keeps them per deployment; models without one take the server's
(VIT_SERVE_REPLICAS, --replicas, ...). Read from the application Ray Serve would run (its bound deployments), no
cluster started."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from vit_serve.deploy.ray import Deployment, ResourceRequest, _build, resource_shortfall
from vit_serve.runtime.backends.ray import deployment_name
from vit_serve.serve.settings import ServeSettings


@pytest.fixture(scope="module")
def repo(tmp_path_factory, save_tiny) -> Path:
    """Two models: plain (no config) and big (config.toml: 3 to 5 replicas of half a CPU and one GPU each)."""
    folder = tmp_path_factory.mktemp("ray_sizes")
    for name in ("plain", "big"):
        (folder / name / "1").mkdir(parents=True)
        save_tiny(folder / name / "1" / "model.safetensors", (32, 32), 3, ["a", "b"])
    (folder / "big" / "config.toml").write_text("replicas = 3\nmax_replicas = 5\nreplica_cpus = 0.5\n"
                                                "replica_gpus = 1\n")
    return folder


def _settings(repo: Path, **kw) -> ServeSettings:
    return ServeSettings.of({"device": "cpu", "threads": 1, "decode_workers": 1, **kw}, model=str(repo))


def _deployments(app) -> dict[str, object]:
    """The model deployments of an application, by name (Ray's own objects: the ingress's bound arguments)."""
    models = app._bound_deployment.init_args[1]
    return {m._bound_deployment.name: m._bound_deployment for m in models}


def test_a_models_config_toml_sizes_its_own_deployment(repo):
    app, request = _build(_settings(repo, replicas=2, replica_cpus=0.25))
    found = _deployments(app)
    plain, big = (found[deployment_name(n, repo / n / "1" / "model.safetensors")] for n in ("plain", "big"))
    assert plain.num_replicas == 2 and plain.ray_actor_options["num_cpus"] == 0.25
    assert "num_gpus" not in plain.ray_actor_options  # and CUDA hidden (actor_options)
    scaling = big._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (3, 5)
    assert big.ray_actor_options["num_cpus"] == 0.5 and big.ray_actor_options["num_gpus"] == 1
    assert request == ResourceRequest(1, 2, 0.25, 0.0, 1, 1.0, False, (("big", Deployment(3, 5, 0.5, 1.0)),))


def test_the_build_arguments_are_the_defaults_of_models_without_their_own(repo):
    app, request = _build(_settings(repo), num_replicas=4, ray_actor_options={"num_cpus": 0.5})
    found = {name.split("-")[0]: d for name, d in _deployments(app).items()}
    assert found["plain"].num_replicas == 4 and found["plain"].ray_actor_options["num_cpus"] == 0.5
    assert found["big"]._deployment_config.autoscaling_config.max_replicas == 5
    assert (request.deployments, request.replicas, request.ingress_replicas) == (1, 4, 1)


def test_the_shortfall_counts_each_models_own_deployment(repo):
    _, request = _build(_settings(repo, ingress_replicas=2))
    assert resource_shortfall(request, {"CPU": 4.0, "GPU": 8.0}) == (
        "1 model replica x 1 CPU + big: 5 x 0.5 CPU + 2 ingress x 1 CPU = 5.5 CPUs, the cluster has 4: lower "
        "--replicas (or a model's config.toml replicas, max_replicas) or --replica-cpus")
    assert resource_shortfall(request, {"CPU": 8.0, "GPU": 2.0}) == (
        "1 model replica x 0 GPU + big: 5 x 1 GPU = 5 GPUs, the cluster has 2: lower --replicas (or a model's "
        "config.toml replicas, max_replicas) or --replica-gpus")
    assert resource_shortfall(request, {"CPU": 8.0, "GPU": 5.0}) is None


def test_replicas_above_max_replicas_is_refused(repo, tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.safetensors").write_bytes((repo / "plain" / "1" / "model.safetensors").read_bytes())
    (tmp_path / "m" / "config.toml").write_text("replicas = 4\nmax_replicas = 2\n")
    with pytest.raises(ValueError, match=r"model m: replicas \(4\) is above max_replicas \(2\)"):
        _build(_settings(tmp_path))
